"""The simulator as a library: ``SimSettings`` → ``Simulation`` → results.

    from pdserve.sim import SimSettings, Simulation

    sim = Simulation(SimSettings(hardware="H100", model_profile="Llama-3-8B", mode="disaggregated"))
    demo = sim.demo(prompt_len=8192, chunk_size=1024, num_decodes=24)      # a DemoResult
    runs = sim.architectures(requests)                                     # one ArchitectureRun per mode

``SimSettings`` holds what every simulation shares: the hardware and model profiles (hence the cost
model), the architecture (``mode``, ``prefill_workers``, ``decode_workers``), the engine's settings and
the targets. Its option fields are ``pdserve sim``'s flags (``pdserve.options``); the worker counts, the
engine and the auto threshold carry the deployment's, the engine's and the router's own options.
``Simulation`` checks them and builds the cost model (``ValueError`` for anything it cannot take);
each of its methods is one of ``pdserve sim``'s actions and returns that action's result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.config import EngineConfig
from pdserve.messages import Mode
from pdserve.options import option
from pdserve.router.config import RouterConfig
from pdserve.sim.config import SimConfig

if TYPE_CHECKING:
    from pdserve.sim.cost_model import CostModel
    from pdserve.sim.demo import ChunkingComparison, DemoArchitecture, DemoResult
    from pdserve.sim.experiments import Architecture, PDRow
    from pdserve.sim.replay import ReplayReport
    from pdserve.sim.simulator import SimResult
    from pdserve.workload.generator import WorkloadRequest, WorkloadSpec
    from pdserve.workload.metrics import SweepPoint

DEFAULT_CALIBRATION = os.path.join("results", "cpu-profile.json")
ARCHITECTURE_CHOICES = (*Mode, "both", "all")  # both: colocated, disaggregated


@dataclass(frozen=True)
class SimSettings:
    """What every simulation of one ``pdserve sim`` call shares.

    ``mode`` ``both`` compares colocated with disaggregated, ``all`` adds auto. In a comparison the
    colocated side runs on ``prefill_workers + decode_workers`` instances (the same GPUs); run alone it
    has ``decode_workers`` instances (as in ``pdserve serve``). ``prefill_workers=None`` is 1.
    """

    hardware: str = option("H100", "hardware profile: A100, H100, H200 or cpu-measured (this CPU, calibrated)")
    model_profile: str | None = option(
        None, "model profile: Llama-3-8B, Llama-3-70B, tiny or bench (default: Llama-3-8B; cpu-measured: its own)"
    )
    tp: int = option(1, "tensor-parallel GPUs per instance")
    calibration: str = option(DEFAULT_CALIBRATION, "the cpu-measured profile JSON to read")
    combine: str = option("max", "roofline: a step takes max(compute, memory) or their sum", choices=("max", "sum"))
    mode: str = option("both", "both: colocated and disaggregated; all: and auto", choices=ARCHITECTURE_CHOICES)
    kv_bandwidth_gb_s: float | None = option(
        None, "KV link bandwidth in GB/s (default: the hardware's)", flag="--kv-bandwidth"
    )
    kv_latency_us: float | None = option(None, "KV link latency in microseconds (default: the hardware's)")
    step_tail: bool = option(True, "the machine's measured slowdown and latency tails (cpu-measured)", flag="--no-tail")
    cost_profile: str | None = option(
        None,
        "step costs from per-phase polynomials in a JSON file (replaces --hardware and --model-profile; "
        "the format is in docs/simulator.md)",
    )
    coalesce_decode_steps: bool = option(
        True,
        "advance a decode instance's runs of identical decode-only steps at once (the same results, faster)",
        flag="--no-coalesce",
    )
    keep_steps: bool = option(
        True, "keep every step's record (timelines, results.json); --no-steps only counts them", flag="--no-steps"
    )
    slo: str = option("", "SLOs in ms, e.g. ttft=200,tpot=50")
    itl_target_ms: float = option(50.0, "the inter-token latency target in ms (demo, sweep knee)")
    # from the other commands' declarations: the deployment's, the engine's, the router's, the workload's
    prefill_workers: int | None = None
    decode_workers: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    auto_min_remote_tokens: int = RouterConfig().auto_min_remote_tokens
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ARCHITECTURE_CHOICES:
            raise ValueError(f"mode must be one of {', '.join(ARCHITECTURE_CHOICES)}, got {self.mode!r}")
        for name in ("tp", "decode_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_workers is not None and self.prefill_workers < 1:
            raise ValueError(f"prefill_workers must be >= 1, got {self.prefill_workers}")

    @property
    def modes(self) -> list[str]:
        """The architectures a workload runs on."""
        choices: dict[str, list[str]] = {"both": [Mode.COLOCATED, Mode.DISAGGREGATED], "all": list(Mode)}
        return choices.get(self.mode, [self.mode])

    @property
    def num_prefill(self) -> int:
        return 1 if self.prefill_workers is None else self.prefill_workers

    def colocated_instances(self, comparing: bool) -> int:
        """Colocated instances: prefill + decode when compared with the other architectures, else decode."""
        return self.num_prefill + self.decode_workers if comparing else self.decode_workers

    def demo_architecture(self) -> DemoArchitecture:
        """Where the demo runs: ``mode`` (``both``/``all``: colocated) on these workers."""
        from pdserve.sim.demo import DemoArchitecture

        mode = "colocated" if self.mode in ("both", "all") else self.mode
        return DemoArchitecture(mode, self.decode_workers, self.num_prefill, self.decode_workers)


@dataclass(frozen=True)
class ArchitectureRun:
    """One architecture's run of a workload."""

    name: str  # "colocated x2", "disaggregated 1P:1D"
    mode: str
    result: SimResult


class Simulation:
    """A simulator prepared from ``SimSettings``: the cost model and the simulated engine's settings.

    Raises ``ValueError`` for a profile that does not exist or does not fit, or bad SLOs."""

    def __init__(self, settings: SimSettings) -> None:
        from pdserve.workload.metrics import parse_slo

        self.settings = settings
        self.slo_ms: dict[str, float] = parse_slo(settings.slo)
        self.cost_model, link = cost_model_of(settings)
        if settings.kv_bandwidth_gb_s is not None:
            link["kv_link_bw"] = settings.kv_bandwidth_gb_s * 1e9
        if settings.kv_latency_us is not None:
            link["kv_link_latency_s"] = settings.kv_latency_us * 1e-6
        self.config: SimConfig = SimConfig.from_engine_config(
            settings.engine,
            **link,
            step_tail=settings.step_tail,
            seed=settings.seed,
            auto_min_remote_tokens=settings.auto_min_remote_tokens,
            coalesce_decode_steps=settings.coalesce_decode_steps,
            keep_steps=settings.keep_steps,
        )

    def demo(
        self, prompt_len: int = 8192, chunk_size: int | None = 1024, num_decodes: int = 24, **kwargs: Any
    ) -> DemoResult:
        """The chunked-prefill demo once (``chunk_size=None``: chunking off) on the settings' architecture."""
        from pdserve.sim.demo import run_chunked_prefill_demo

        return run_chunked_prefill_demo(
            self.cost_model,
            prompt_len,
            chunk_size,
            num_decodes,
            self.settings.itl_target_ms,
            architecture=self.settings.demo_architecture(),
            base=self.config,
            **kwargs,
        )

    def compare_chunking(
        self, prompt_len: int = 32768, chunk_size: int = 1024, num_decodes: int = 24
    ) -> ChunkingComparison:
        """The demo's scenario with chunking off and on."""
        from pdserve.sim.demo import compare_chunking

        return compare_chunking(
            self.cost_model,
            prompt_len,
            chunk_size,
            num_decodes,
            self.settings.itl_target_ms,
            architecture=self.settings.demo_architecture(),
            base=self.config,
        )

    def architectures(
        self, requests: Sequence[WorkloadRequest], max_concurrency: int | None = None
    ) -> list[ArchitectureRun]:
        """``requests`` on each of the settings' architectures."""
        from pdserve.sim.simulator import simulate

        runs = []
        for arch in self._architectures():
            result = simulate(
                requests,
                self.cost_model,
                self.config,
                mode=arch.mode,
                num_instances=arch.num_instances,
                num_prefill=max(arch.num_prefill, 1),  # the counts a mode does not use must still be >= 1
                num_decode=max(arch.num_decode, 1),
                tp=self.settings.tp,
                max_concurrency=max_concurrency,
            )
            runs.append(ArchitectureRun(arch.name, arch.mode, result))
        return runs

    def _architectures(self) -> list[Architecture]:
        """The settings' architectures, named as reports show them ("colocated x2", "disaggregated 1P:1D")."""
        from pdserve.sim.experiments import Architecture

        s, chunked = self.settings, self.config.enable_chunked_prefill
        archs = []
        for mode in s.modes:
            if mode == "colocated":
                n = s.colocated_instances(comparing=len(s.modes) > 1)
                archs.append(Architecture(f"colocated x{n}", mode, 0, 0, n, chunked))
            else:
                name = f"{mode} {s.num_prefill}P:{s.decode_workers}D"
                n = s.num_prefill + s.decode_workers
                archs.append(Architecture(name, mode, s.num_prefill, s.decode_workers, n, chunked))
        return archs

    def chunk_sweep(
        self, requests: Sequence[WorkloadRequest], chunk_sizes: Sequence[int], max_concurrency: int | None = None
    ) -> list[SweepPoint]:
        """P99 ITL against prefill throughput per chunk size, on ``decode_workers`` colocated instances."""
        from pdserve.sim.experiments import chunk_sweep

        return chunk_sweep(
            requests,
            self.cost_model,
            list(chunk_sizes),
            self.config,
            num_instances=self.settings.decode_workers,
            max_concurrency=max_concurrency,
        )

    def pd_search(
        self,
        spec: WorkloadSpec,
        num_gpus: int,
        attainment: float = 0.9,
        search_rate: bool = True,
        min_duration_s: float = 0.0,
        progress: Callable[[str], None] | None = None,
    ) -> list[PDRow]:
        """Colocated against every P:D split of ``num_gpus``, goodput per GPU under the settings' SLOs;
        ``progress`` hears one line per configuration."""
        from pdserve.sim.experiments import pd_search

        return pd_search(
            spec,
            self.cost_model,
            num_gpus,
            self.slo_ms,
            self.config,
            tp=self.settings.tp,
            attainment=attainment,
            search_rate=search_rate,
            min_duration_s=min_duration_s,
            progress=progress,
        )

    def replay(self, path: str) -> list[tuple[str, ReplayReport]]:
        """Every run of a results file (``sim.replay.load_recorded_runs``) replayed with its recorded step
        durations: ``(run name, report)`` each. A simulated run replays under its own simulator settings
        and must have been simulated on this cost model; a measured run under these settings (the engine
        options and latencies: give the run's, e.g. ``hardware="cpu-measured"``). Raises ValueError for
        a file that cannot be replayed."""
        from pdserve.sim.replay import load_recorded_runs, replay

        out = []
        for run in load_recorded_runs(path):
            if run.cost_model is not None and run.cost_model != self.cost_model.name:
                raise ValueError(
                    f"--replay: run {run.name!r} was simulated on {run.cost_model}, not {self.cost_model.name}: "
                    "give its --hardware, --model-profile (or --cost-profile) and --tp"
                )
            report = replay(
                run.requests,
                run.records,
                run.steps,
                self.cost_model,
                run.sim_config or self.config,
                mode=run.mode,
                time_origin=run.time_origin,
                num_instances=run.counts.get("num_instances", 1),
                num_prefill=run.counts.get("num_prefill", 1),
                num_decode=run.counts.get("num_decode", 1),
            )
            out.append((run.name, report))
        return out

    def goodput(
        self, spec: WorkloadSpec, attainment: float = 0.9, search_rate: bool = True, min_duration_s: float = 0.0
    ) -> list[PDRow]:
        """Per architecture of the settings: the SLO attainments at the workload's rate and the goodput
        per GPU (the highest rate at which ``attainment`` of the requests meet every SLO, by a rate
        search), best first. Raises ``ValueError`` without SLOs."""
        from pdserve.sim.experiments import rank_rows, search_goodput

        if not self.slo_ms:
            raise ValueError("--goodput: give SLOs, e.g. --slo ttft=200,tpot=50")
        rows = [
            search_goodput(
                arch,
                spec,
                self.cost_model,
                self.slo_ms,
                self.config,
                tp=self.settings.tp,
                attainment=attainment,
                search_rate=search_rate,
                min_duration_s=min_duration_s,
            )
            for arch in self._architectures()
        ]
        return rank_rows(rows)


def cost_model_of(settings: SimSettings) -> tuple[CostModel, dict[str, Any]]:
    """``settings.cost_profile`` when given (it sets the model's KV size and the KV link), else
    ``make_cost_model`` of the named profiles."""
    if not settings.cost_profile:
        return make_cost_model(
            settings.hardware, settings.model_profile, settings.tp, settings.calibration, settings.combine
        )
    from pdserve.sim.cost_profile import PolynomialCostModel, load_cost_profile

    if settings.model_profile is not None:
        raise ValueError("--cost-profile gives the model's sizes: drop --model-profile")
    profile = load_cost_profile(settings.cost_profile)
    return PolynomialCostModel(profile), profile.sim_settings()


def make_cost_model(
    hardware: str,
    model_profile: str | None,
    tp: int = 1,
    calibration: str = DEFAULT_CALIBRATION,
    combine: str = "max",
) -> tuple[CostModel, dict[str, Any]]:
    """``(cost model, SimConfig fields it implies)`` for the named profiles: the KV link of the hardware,
    and for cpu-measured the deployment latencies and the machine's slowdown it measured too."""
    from pdserve.sim.cost_model import LinearCostModel, RooflineCostModel
    from pdserve.sim.profiles import CPU_MEASURED, get_hardware, get_model, load_linear_profile

    if hardware.lower() == CPU_MEASURED:
        prof = load_linear_profile(calibration)
        name = model_profile or prof.model
        if name.lower() != prof.model.lower():
            raise ValueError(f"hardware cpu-measured: {calibration} was measured on model {prof.model!r}, not {name!r}")
        if tp != 1:
            raise ValueError("hardware cpu-measured: --tp is not modelled (measured on one process)")
        return LinearCostModel(prof, get_model(name)), prof.sim_settings()
    hw = get_hardware(hardware)
    link = {"kv_link_bw": hw.kv_link_bw, "kv_link_latency_s": hw.kv_link_latency_s}
    return RooflineCostModel(hw, get_model(model_profile or "Llama-3-8B"), tp, combine), link
