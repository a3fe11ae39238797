"""Step-time simulator: replays workloads through the real engine scheduler on a cost model.

Entry points: ``simulate`` (one run), ``bench.sim.demo`` (the chunked-prefill demo),
``bench.sim.experiments`` (chunk sweep, P:D search), ``bench.sim.calibrate`` (cpu-measured profile),
``bench.sim.cli.main`` (``pdserve sim``).
"""

from __future__ import annotations

from pdserve.bench.sim.config import SimConfig
from pdserve.bench.sim.cost_model import LinearCostModel, RooflineCostModel, StepShape
from pdserve.bench.sim.profiles import HARDWARE, MODELS, get_hardware, get_model
from pdserve.bench.sim.simulator import SimResult, simulate

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
