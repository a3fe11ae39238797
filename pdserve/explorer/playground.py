"""The playground: the chunked-prefill demo of ``pdserve sim --demo``, run for one set of controls.

A ``PlaygroundSettings`` is what the page's controls say. ``PlaygroundSettings.parse`` checks a JSON
body and raises ``SettingError`` (naming the control) for anything out of range. ``run_playground``
turns the settings into the simulator's ``SimSettings`` (``pdserve.sim``'s library API, which ``pdserve
sim`` calls too) and runs the demo twice: as set, and with chunking flipped (so the page can show the
unchunked spike against the chunked timeline). Nothing here is a copy of the simulator's logic: the
figures are ``Simulation.demo``'s, the same numbers ``pdserve sim --demo`` prints for the command line
``sim_argv`` shows.

What the page explains from a run (``with_run_detail``: each step's kind and roofline split, the
arrival and first token; ``cost_model_assumptions``) and its chunk-size sweep (``run_chunk_sweep``) are
added after the runs, in functions of their own. ``estimated_work`` is what a run costs the server; a
setting past ``MAX_WORK`` is refused with the ``pdserve sim`` command that runs it anyway.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from pdserve.explorer.timeline import step_row
from pdserve.messages import Mode

if TYPE_CHECKING:  # the simulator is imported when a run is asked for, not with the router
    from pdserve.messages import StepStats
    from pdserve.sim import SimSettings
    from pdserve.sim.cost_model import CostModel
    from pdserve.sim.demo import DemoResult

MAX_CHUNKS = 1024  # prompt_len / chunk_size: more steps than this would keep the page waiting
MAX_WORK = 150_000  # estimated_work's request-steps: a change on a small CPU answers within seconds
STEP_WORK = 50  # one simulated step costs about as much as placing 50 requests in a step
WARMUP_RERUNS = 4  # the streams' warm-up is simulated about this many times (the demo reruns to a horizon)
BATCH_WORK = 64  # a step of n requests costs n x (1 + n / BATCH_WORK) request-steps
MAX_INSTANCES = 8
MAX_DECODES = 127  # the long prompt needs a place in a step of at most max_num_seqs (128) requests


class SettingError(ValueError):
    """A control's value is out of range; ``field`` names the control."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PlaygroundSettings:
    """The playground's controls (the defaults are the lesson's: an 8k prompt, chunk 1024, 24 decodes)."""

    hardware: str = "H100"
    model: str = "Llama-3-8B"
    tp: int = 1
    mode: str = "colocated"
    instances: int = 1  # colocated
    prefill: int = 1  # disaggregated / auto
    decode: int = 1
    prompt_len: int = 8192
    chunk_size: int = 1024
    chunking: bool = True
    num_decodes: int = 24
    itl_target_ms: float = 50.0

    @staticmethod
    def parse(body: Any) -> PlaygroundSettings:
        """Settings from a JSON object (missing keys take their defaults). Raises SettingError."""
        if not isinstance(body, dict):
            raise SettingError("body", "expected a JSON object of settings")
        known = {f.name: f for f in fields(PlaygroundSettings)}
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise SettingError(unknown[0], f"unknown setting (known: {', '.join(known)})")
        values = {name: _coerce(name, body[name], type(getattr(_DEFAULTS, name))) for name in body}
        settings = PlaygroundSettings(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise SettingError for a value no run can take (profile-dependent limits: ``run_playground``)."""
        from pdserve.sim.profiles import HARDWARE_NAMES, MODELS

        if self.hardware.lower() not in {h.lower() for h in HARDWARE_NAMES}:
            raise SettingError("hardware", f"unknown profile {self.hardware!r} (known: {', '.join(HARDWARE_NAMES)})")
        if self.model.lower() not in {m.lower() for m in MODELS}:
            raise SettingError("model", f"unknown model profile {self.model!r} (known: {', '.join(MODELS)})")
        if self.mode not in list(Mode):
            raise SettingError("mode", f"must be one of {', '.join(Mode)}, got {self.mode!r}")
        _in_range("tp", self.tp, 1, 8)
        for name in ("instances", "prefill", "decode"):
            _in_range(name, getattr(self, name), 1, MAX_INSTANCES)
        _in_range("prompt_len", self.prompt_len, 1, 1 << 20)
        _in_range("chunk_size", self.chunk_size, 16, 1 << 20)
        _in_range("num_decodes", self.num_decodes, 0, MAX_DECODES)
        if not 1.0 <= self.itl_target_ms <= 10_000.0:
            raise SettingError("itl_target_ms", f"must be between 1 and 10000 ms, got {self.itl_target_ms:g}")
        if self.prompt_len / self.chunk_size > MAX_CHUNKS:  # the flipped run is chunked when this one is not
            raise SettingError(
                "chunk_size",
                f"a {self.prompt_len}-token prompt in chunks of {self.chunk_size} is "
                f"{-(-self.prompt_len // self.chunk_size)} steps; the playground takes at most {MAX_CHUNKS} "
                f"(use at least {-(-self.prompt_len // MAX_CHUNKS)}, or run pdserve sim --demo)",
            )
        work = estimated_work(self)
        if work > MAX_WORK:
            chunks = -(-self.prompt_len // self.chunk_size)
            raise SettingError(
                "chunk_size",
                f"a {self.prompt_len}-token prompt in {chunks} chunks next to {self.num_decodes} decodes on "
                f"{self.total_instances} instance(s) is about {work:,} request-steps of simulation; the page takes "
                f"at most {MAX_WORK:,} (a few seconds here). Use a larger chunk, fewer decodes or fewer instances, "
                f"or run it yourself: {shlex.join(['pdserve', 'sim', *self.sim_argv()])}",
            )

    @property
    def total_instances(self) -> int:
        return self.instances if self.mode == "colocated" else self.prefill + self.decode

    def sim_settings(self) -> SimSettings:
        """The simulator's settings of this demo."""
        from pdserve.sim import SimSettings

        colocated = self.mode == "colocated"
        return SimSettings(
            hardware=self.hardware,
            model_profile=self.model,
            tp=self.tp,
            mode=self.mode,
            prefill_workers=None if colocated else self.prefill,
            decode_workers=self.instances if colocated else self.decode,
            itl_target_ms=self.itl_target_ms,
        )

    def sim_argv(self) -> list[str]:
        """The ``pdserve sim`` arguments that run this demo (chunking on and off both: ``--demo``), for
        people to run it themselves."""
        argv = ["--demo", "--hardware", self.hardware, "--model-profile", self.model, "--tp", str(self.tp)]
        argv += ["--mode", self.mode]
        if self.mode == "colocated":
            argv += ["--decode-workers", str(self.instances)]
        else:
            argv += ["--prefill-workers", str(self.prefill), "--decode-workers", str(self.decode)]
        argv += ["--demo-prompt-len", str(self.prompt_len), "--demo-chunk", str(self.chunk_size)]
        argv += ["--demo-decodes", str(self.num_decodes), "--itl-target-ms", f"{self.itl_target_ms:g}"]
        return argv


_DEFAULTS = PlaygroundSettings()


def estimated_work(settings: PlaygroundSettings) -> int:
    """What a playground run costs the server, in request-steps (one request placed in one simulated step):
    every instance steps through the window (one step per chunk of the long prompt, ``STEP_WORK`` each),
    the window's steps carry all the requests (a fuller step costs more per request), and the streams'
    warm-up (their 512-token prompts in chunks) is simulated ``WARMUP_RERUNS`` times. Counts instances:
    eight idle instances step as often as one busy one. Both runs count (chunked at ``chunk_size`` and
    unchunked), whichever the settings show first."""

    def one_run(chunk: int) -> int:
        chunks = -(-settings.prompt_len // chunk)
        warmup_steps = -(-settings.num_decodes * 512 // chunk)
        requests = settings.num_decodes + 1
        per_step = requests * (1 + requests / BATCH_WORK)  # a fuller step costs more per request
        return chunks * settings.total_instances * STEP_WORK + int((chunks + WARMUP_RERUNS * warmup_steps) * per_step)

    return one_run(settings.chunk_size) + one_run(settings.prompt_len)  # the run as set and the flipped one


def _coerce(name: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (JSON numbers and booleans as they come; nothing else is converted)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise SettingError(name, f"expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise SettingError(name, f"expected a whole number, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise SettingError(name, f"expected a number, got {value!r}")
        return float(value)
    if not isinstance(value, str) or not value:
        raise SettingError(name, f"expected a name, got {value!r}")
    return value


def _in_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise SettingError(name, f"must be between {low} and {high}, got {value}")


def run_playground(settings: PlaygroundSettings) -> dict[str, Any]:
    """The demo as set and with chunking flipped: figures and per-instance timelines, as JSON-ready data.

    Raises SettingError for settings the chosen profile cannot take (a prompt past the model's context,
    a model that does not fit the GPUs, a scenario larger than the KV cache)."""
    from pdserve.sim import Simulation

    started = time.perf_counter()
    try:
        sim = Simulation(settings.sim_settings())
    except ValueError as e:
        raise SettingError("hardware", str(e)) from None
    _check_fits(settings, sim.cost_model)
    if settings.num_decodes >= sim.config.max_num_seqs:
        raise SettingError(
            "num_decodes",
            f"at most {sim.config.max_num_seqs - 1} (max_num_seqs is "
            f"{sim.config.max_num_seqs} and the long prompt needs a place)",
        )
    chunks = (settings.chunk_size, None) if settings.chunking else (None, settings.chunk_size)
    runs = [sim.demo(settings.prompt_len, chunk, settings.num_decodes) for chunk in chunks]
    return {
        "settings": asdict(settings),
        "command": shlex.join(["pdserve", "sim", *settings.sim_argv()]),
        "cost_model": sim.cost_model.name,
        "kv_capacity_tokens": sim.cost_model.kv_capacity_tokens(),  # checked by _check_fits
        "runs": [with_run_detail(_run_json(r, sim.cost_model), r, sim.cost_model) for r in runs],
        "assumptions": cost_model_assumptions(sim.cost_model),
        "elapsed_s": time.perf_counter() - started,
    }


def _check_fits(settings: PlaygroundSettings, cost_model: CostModel) -> None:
    model = cost_model.model
    if settings.prompt_len >= model.max_context:
        raise SettingError(
            "prompt_len",
            f"{model.name} takes at most {model.max_context} tokens (prompt and output); got a "
            f"{settings.prompt_len}-token prompt",
        )
    try:
        capacity = cost_model.kv_capacity_tokens()
    except ValueError as e:  # the weights alone do not fit
        raise SettingError("tp", str(e).replace("raise --tp", "choose a larger tensor-parallel size")) from None
    needed = settings.prompt_len + settings.num_decodes * 1024  # each stream: a 512-token prompt and its output
    if needed > capacity:
        raise SettingError(
            "num_decodes",
            f"one instance's KV cache holds {capacity} tokens; this scenario needs about {needed} on one "
            f"instance (fewer decodes, a shorter prompt, or a larger tp)",
        )


def _run_json(result: DemoResult, cost_model: CostModel) -> dict[str, Any]:
    """One run for the page: its four figures and every instance's steps around the window (ms since
    the long prompt arrived)."""
    t0 = result.arrival_s
    instances = []
    for name in result.instances:
        role = _role(name, result.architecture)
        steps = [s for s in result.timeline_steps if s.worker == name]
        instances.append({"name": name, "role": role, "steps": [_step_json(s, t0, cost_model, role) for s in steps]})
    return {
        "label": f"chunk {result.chunk_size}" if result.chunk_size else "chunking off",
        "chunked": result.chunk_size is not None,
        "architecture": result.architecture,
        "figures": {
            "worst_decode_stall_ms": result.worst_decode_stall_ms,
            "long_prompt_ttft_ms": result.long_prompt_ttft_ms,
            "steps_over_target": result.steps_over_target,
            "steps_in_window": result.steps_in_window,
            "decode_throughput_tok_s": result.decode_throughput_tok_s,
        },
        "window_ms": [0.0, result.long_prompt_ttft_ms],
        "instances": instances,
    }


def _role(instance: str, architecture: str) -> str:
    if architecture.startswith("colocated"):
        return "colocated"
    return "prefill" if instance.startswith("prefill") else "decode"


def _step_json(step: StepStats, t0: float, cost_model: CostModel, role: str) -> list[float]:
    """The step's timeline row (ms since ``t0``), its time split between its prefill and decode work in
    the proportion the cost model prices them alone."""
    from pdserve.sim.cost_model import StepShape

    prefill, decode = StepShape.from_stats(step).split()
    prefill_s = cost_model.step_time(prefill, role) if prefill.prefill_tokens else 0.0
    decode_s = cost_model.step_time(decode, role) if decode.decode_tokens else 0.0
    share = prefill_s / (prefill_s + decode_s) if prefill_s + decode_s > 0 else 0.0
    return step_row(step, (step.started - t0) * 1000.0, share)


# ---- what the page explains: step kinds, the cost model's assumptions, the chunk-size sweep ------------------

SWEEP_CHUNKS = (128, 256, 512, 1024, 2048, 4096, 8192)  # the lesson's exercise: chunk 128 ... 8192
SWEEP_MAX_WORK = 2 * MAX_WORK  # all the sweep's runs together


def with_run_detail(run: dict[str, Any], result: DemoResult, cost_model: CostModel) -> dict[str, Any]:
    """``run`` (``_run_json``'s) with what the page's caption and step-through read: the long prompt's
    arrival and first token (ms since arrival), the p99 ITL and prefill throughput over the window, and
    per instance ``kinds`` (each step: ``long`` carries the long prompt's chunk, ``warmup`` the streams'
    own prompts, ``decode`` no prefill) and ``bound`` (``[compute ms, memory ms]`` of the roofline, or
    null for a measured cost model)."""
    ttft = result.long_prompt_ttft_ms
    run["arrival_ms"] = 0.0
    run["first_token_ms"] = ttft
    run["prompt_len"] = result.prompt_len
    run["num_decodes"] = result.num_decodes
    run["p99_itl_ms"] = window_p99_itl_ms(result)
    run["prefill_throughput_tok_s"] = result.prompt_len / (ttft / 1000.0) if ttft > 0 else 0.0
    by_name = {name: [s for s in result.timeline_steps if s.worker == name] for name in result.instances}
    for inst in run["instances"]:
        steps = by_name[inst["name"]]
        inst["kinds"] = [_step_kind(s, result) for s in steps]
        inst["bound"] = [_roofline_split_ms(s, cost_model) for s in steps]
    return run


def window_p99_itl_ms(result: DemoResult) -> float:
    """The p99 inter-token latency of the streams over the window: each step that carries decode tokens
    counts its duration once per stream token it makes (the steps run back to back)."""
    samples = sorted(s.duration_s * 1000.0 for s in result.window_steps for _ in range(s.num_decode_tokens))
    if not samples:
        return 0.0
    return samples[min(len(samples) - 1, max(0, -(-99 * len(samples) // 100) - 1))]


def _step_kind(step: StepStats, result: DemoResult) -> str:
    if not step.num_prefill_tokens:
        return "decode"
    arrival, first = result.arrival_s, result.arrival_s + result.long_prompt_ttft_ms / 1000.0
    return "long" if arrival - 1e-9 <= step.started < first else "warmup"


def _roofline_split_ms(step: StepStats, cost_model: CostModel) -> list[float] | None:
    from pdserve.sim.cost_model import RooflineCostModel, StepShape

    if not isinstance(cost_model, RooflineCostModel):
        return None
    cost = cost_model.breakdown(StepShape.from_stats(step))
    return [round(cost.compute * 1000.0, 3), round(cost.memory * 1000.0, 3)]


def cost_model_assumptions(cost_model: CostModel) -> dict[str, Any]:
    """What the cost model assumes, for the page to state: a roofline's hardware and model figures, or
    a measured linear fit's name."""
    from pdserve.sim.cost_model import RooflineCostModel
    from pdserve.sim.profiles import ModelProfile

    model = cost_model.model
    assert isinstance(model, ModelProfile)  # the page's profiles are built in, never a cost-profile file
    out: dict[str, Any] = {"name": cost_model.name, "model": model.name, "params_b": model.num_params / 1e9}
    out["dtype_bytes"] = model.dtype_bytes
    if not isinstance(cost_model, RooflineCostModel):
        return {**out, "kind": "measured"}
    hw = cost_model.hardware
    return {
        **out,
        "kind": "roofline",
        "hardware": hw.name,
        "tp": cost_model.tp,
        "peak_tflops": hw.peak_flops / 1e12,
        "mfu": hw.mfu,
        "mem_bw_tb_s": hw.mem_bw / 1e12,
        "bw_efficiency": hw.bw_efficiency,
        "step_overhead_ms": hw.step_overhead_s * 1000.0,
        "seq_overhead_us": hw.seq_overhead_s * 1e6,
        "combine": cost_model.combine,
    }


def run_chunk_sweep(settings: PlaygroundSettings) -> dict[str, Any]:
    """The page's scenario with chunking on at every chunk size of ``SWEEP_CHUNKS`` up to the prompt
    length: p99 ITL and worst stall against prefill throughput, and the knee for the ITL target (the
    largest prefill throughput whose p99 ITL meets it). A chunk size past the page's work limit, or past
    the sweep's (``SWEEP_MAX_WORK`` for all its runs, the largest chunks first), is listed as skipped.
    Raises SettingError as ``run_playground`` does."""
    from pdserve.sim import Simulation

    started = time.perf_counter()
    try:
        sim = Simulation(settings.sim_settings())
    except ValueError as e:
        raise SettingError("hardware", str(e)) from None
    _check_fits(settings, sim.cost_model)
    points: list[dict[str, Any]] = []
    budget = SWEEP_MAX_WORK
    for chunk in sorted((c for c in SWEEP_CHUNKS if c <= max(settings.prompt_len, SWEEP_CHUNKS[0])), reverse=True):
        point: dict[str, Any] = {"chunk_size": chunk}
        at_chunk = PlaygroundSettings(**{**asdict(settings), "chunk_size": chunk, "chunking": True})
        try:
            at_chunk.check()
        except SettingError as e:
            points.append({**point, "skipped": str(e)})
            continue
        budget -= estimated_work(at_chunk)
        if budget < 0:  # the smaller chunks cost the most: the sweep stops before them
            points.append({**point, "skipped": f"past the sweep's work limit ({SWEEP_MAX_WORK:,} request-steps)"})
            continue
        r = sim.demo(settings.prompt_len, chunk, settings.num_decodes)
        ttft_s = r.long_prompt_ttft_ms / 1000.0
        point.update(
            p99_itl_ms=window_p99_itl_ms(r),
            worst_decode_stall_ms=r.worst_decode_stall_ms,
            long_prompt_ttft_ms=r.long_prompt_ttft_ms,
            prefill_throughput_tok_s=settings.prompt_len / ttft_s if ttft_s > 0 else 0.0,
        )
        points.append(point)
    points.sort(key=lambda p: p["chunk_size"])
    ok = [p for p in points if "skipped" not in p and p["p99_itl_ms"] <= settings.itl_target_ms]
    knee = max(ok, key=lambda p: (p["prefill_throughput_tok_s"], p["chunk_size"]))["chunk_size"] if ok else None
    return {
        "settings": asdict(settings),
        "points": points,
        "knee_chunk_size": knee,
        "elapsed_s": time.perf_counter() - started,
    }
