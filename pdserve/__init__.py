"""pdserve: chunked prefill and disaggregated prefill/decode serving on Ray, with an A/B instrument.

Common names are importable from here (lazily, so ``import pdserve`` loads neither torch nor Ray)::

    from pdserve import LLMEngine, EngineConfig, SamplingParams, Client

The parts keep their own top-level folders in the repository (``engine/``, ``router/``, ``proto/``, …)
and import as ``pdserve.<part>``: ``pyproject.toml`` maps each folder into this package for an install,
and in a source checkout this package's search path is extended to the repository root, so the same
import names work from a clone, an editable install, a wheel, and in Ray workers.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "proto" / "pdserve.proto").is_file():
    __path__.append(str(_CHECKOUT))  # a source checkout: pdserve.engine is <repo>/engine, and so on

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
