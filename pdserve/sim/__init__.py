"""Step-time simulator: replays workloads through the real engine scheduler on a cost model.

Entry points: ``simulate`` (one run), ``sim.demo`` (the chunked-prefill demo),
``sim.experiments`` (chunk sweep, P:D search), ``sim.calibrate`` (cpu-measured profile),
``sim.cli.main`` (``pdserve sim``).
"""

from __future__ import annotations

if __name__ != "pdserve.sim":  # imported as a top-level `sim` (the repository's link to this folder)
    raise ImportError(f"import pdserve.sim, not {__name__}: pdserve's parts have one import name each")

from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import LinearCostModel, RooflineCostModel, StepShape
from pdserve.sim.profiles import HARDWARE, MODELS, get_hardware, get_model
from pdserve.sim.simulator import SimResult, simulate

__all__ = [
    "HARDWARE",
    "MODELS",
    "LinearCostModel",
    "RooflineCostModel",
    "SimConfig",
    "SimResult",
    "StepShape",
    "get_hardware",
    "get_model",
    "simulate",
]
