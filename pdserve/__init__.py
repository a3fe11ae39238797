"""pdserve: chunked prefill and disaggregated prefill/decode serving on Ray, with an A/B instrument.

Common names are importable from here (lazily, so ``import pdserve`` loads neither torch nor Ray)::

    from pdserve import LLMEngine, EngineConfig, SamplingParams, Client

Each part is a folder of this package (``pdserve/engine``, ``pdserve/router``, ``pdserve/proto``, …);
the repository's top-level folders of the same names are links to them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncClient": "pdserve.router.client",
    "Client": "pdserve.router.client",
    "EngineConfig": "pdserve.engine.config",
    "LLMEngine": "pdserve.engine.llm_engine",
    "ModelConfig": "pdserve.engine.config",
    "SamplingParams": "pdserve.engine.sampling_params",
}

__all__ = ["AsyncClient", "Client", "EngineConfig", "LLMEngine", "ModelConfig", "SamplingParams"]

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.router.client import AsyncClient, Client


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
