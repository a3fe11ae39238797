"""pdserve's single-device inference core: no Ray, no gRPC.

Names are imported lazily, so ``engine.scheduler`` and ``engine.block_manager`` (pure Python, used by
the simulator) load without torch.
"""

from __future__ import annotations

if __name__ != "pdserve.engine":  # imported as a top-level `engine` (the repository's link to this folder)
    raise ImportError(f"import pdserve.engine, not {__name__}: pdserve's parts have one import name each")

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Completion": "pdserve.engine.llm_engine",
    "EngineConfig": "pdserve.engine.config",
    "FinishReason": "pdserve.engine.request",
    "LLMEngine": "pdserve.engine.llm_engine",
    "ModelConfig": "pdserve.engine.config",
    "RequestOutput": "pdserve.engine.llm_engine",
    "SamplingParams": "pdserve.engine.sampling_params",
}

__all__ = ["Completion", "EngineConfig", "FinishReason", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.llm_engine import Completion, LLMEngine, RequestOutput
    from pdserve.engine.request import FinishReason
    from pdserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
