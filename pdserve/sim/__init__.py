"""Step-time simulator: replays workloads through the real engine scheduler on a cost model.

The library API (``pdserve sim`` and the explorer's playground both call it): settings → run → result.

    from pdserve.sim import SimSettings, Simulation

    sim = Simulation(SimSettings(hardware="H100", model_profile="Llama-3-8B", mode="disaggregated",
                                 prefill_workers=1, decode_workers=2))
    demo = sim.demo(prompt_len=8192, chunk_size=1024, num_decodes=24)   # DemoResult: .summary(), .to_dict()
    off_on = sim.compare_chunking(prompt_len=32768, chunk_size=1024)   # ChunkingComparison
    runs = sim.architectures(requests)       # one ArchitectureRun (name, mode, SimResult) per mode
    points = sim.chunk_sweep(requests, [256, 512, 1024])               # SweepPoint per chunk size
    rows = sim.pd_search(spec, num_gpus=8, progress=print)             # PDRow per configuration

- ``SimSettings``: hardware and model profiles, tensor parallelism, the architecture (``mode``:
  colocated, disaggregated, auto, both or all; ``prefill_workers``, ``decode_workers``), the KV link,
  the engine (``EngineConfig``), SLOs and the ITL target. Its option fields are ``pdserve sim``'s flags.
- ``Simulation(settings)``: checks them and builds the cost model and the simulated engine's
  ``SimConfig`` (``ValueError`` for profiles that do not exist or do not fit, or bad SLOs); each method
  is one of ``pdserve sim``'s actions.

Lower level: ``simulate`` (one run of requests on a cost model and ``SimConfig``), the cost models and
profiles, ``sim.demo``, ``sim.experiments``, ``sim.calibrate`` (the cpu-measured profile), and
``pdserve.cli.sim.main`` (``pdserve sim``).
"""

from __future__ import annotations

if __name__ != "pdserve.sim":  # imported as a top-level `sim` (the repository's link to this folder)
    raise ImportError(f"import pdserve.sim, not {__name__}: pdserve's parts have one import name each")

from pdserve.sim.api import DEFAULT_CALIBRATION, ArchitectureRun, SimSettings, Simulation, make_cost_model
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import LinearCostModel, RooflineCostModel, StepShape
from pdserve.sim.profiles import HARDWARE, MODELS, get_hardware, get_model
from pdserve.sim.simulator import SimResult, simulate

__all__ = [
    "DEFAULT_CALIBRATION",
    "HARDWARE",
    "MODELS",
    "ArchitectureRun",
    "LinearCostModel",
    "RooflineCostModel",
    "SimConfig",
    "SimResult",
    "SimSettings",
    "Simulation",
    "StepShape",
    "get_hardware",
    "get_model",
    "make_cost_model",
    "simulate",
]
