"""pdserve's single-device inference core: no Ray, no gRPC.

Names are imported lazily, so ``engine.scheduler`` and ``engine.block_manager`` (pure Python, used by
the simulator) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Completion": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "FinishReason": "engine.request",
    "LLMEngine": "engine.llm_engine",
    "ModelConfig": "engine.config",
    "RequestOutput": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
}

__all__ = ["Completion", "EngineConfig", "FinishReason", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import Completion, LLMEngine, RequestOutput
    from engine.request import FinishReason
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
