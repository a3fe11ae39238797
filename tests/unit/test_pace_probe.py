"""The pace probe: the engine times a fixed kernel between steps, the steps carry it, and the simulator and
the validation read the machine's pace from it."""

from __future__ import annotations

import itertools
import math

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.pace_probe import PaceProbe
from pdserve.messages import StepStats, WorkerStats
from pdserve.router.wire import worker_stats_from_proto, worker_stats_to_proto
from pdserve.sim.pace import at_reference_pace, pace_recorded, probe_samples, reference_pace, step_paces

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, [2, 7, 1, 8, 2, 8]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(interval_s: float) -> LLMEngine:
    config = EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, max_model_len=256)
    return LLMEngine(EngineConfig(**{**config.to_dict(), "pace_probe_interval_s": interval_s}))


def test_the_engine_records_its_latest_pace_probe_with_each_step():
    off = _engine(0.0)
    off.generate(PROMPTS, PARAMS)
    assert off.step_history and all(s.pace_s == 0.0 for s in off.step_history)
    assert off.pace_probe.num_probes == 0

    every = _engine(1e-9)  # due after every step
    every.generate(PROMPTS, PARAMS)
    steps = list(every.step_history)
    assert all(s.pace_s > 0 for s in steps)
    assert every.pace_probe.num_probes == len(steps) + 1  # one when the engine was made, one after each step
    assert len({s.pace_s for s in steps}) > 1  # timed again each step, on the thread's CPU clock
    # each step carries the probe taken before it: the one after the previous step
    assert all(a.pace_s != b.pace_s for a, b in itertools.pairwise(steps))

    once = _engine(3600.0)  # the engine's first probe, then not again within the hour
    once.generate(PROMPTS, PARAMS)
    assert once.pace_probe.num_probes == 1 and len({s.pace_s for s in once.step_history}) == 1
    assert all(s.pace_s > 0 and s.cpu_s > 0 for s in once.step_history)


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_a_bad_pace_probe_interval_is_refused(bad):
    with pytest.raises(ValueError, match="pace_probe_interval_s"):
        EngineConfig(pace_probe_interval_s=bad)
    with pytest.raises(ValueError, match="interval"):
        PaceProbe(-1.0)


def test_the_probe_times_the_same_kernel_each_time():
    probe = PaceProbe(0.01)
    times = [probe.time_kernel() for _ in range(5)]
    assert all(t > 0 for t in times)
    assert max(times) < 50 * min(times)  # one fixed amount of work (a loaded machine may stretch one a lot)


def test_the_pace_travels_with_the_step_records_over_grpc():
    step = StepStats(100.0, 0.05, cpu_s=0.04, pace_s=0.0021, worker="decode-0")
    stats = WorkerStats("decode-0", "decode", 64, 60, 0, 4, 1, 0, 0, 12, 8, 0, steps=(step,))
    assert worker_stats_from_proto(worker_stats_to_proto(stats)).steps == (step,)


def _steps(worker: str, paces: list[float], start: float = 0.0, every: int = 2) -> list[StepStats]:
    """One step per 0.5 s on ``worker``; a new probe every ``every`` steps, at the paces given in turn."""
    out = []
    for i in range(every * len(paces)):
        out.append(StepStats(start + 0.5 * i, 0.1, cpu_s=0.08, worker=worker, pace_s=paces[i // every]))
    return out


def test_probe_samples_the_step_paces_and_a_reference_pace():
    steps = _steps("w0", [1.0, 1.0 + 1e-9, 2.0, 2.0 + 1e-9]) + _steps("w1", [3.0, 3.0 + 1e-9], start=0.25)
    samples = probe_samples(steps)
    assert [v for _, v in samples["w0"]] == [1.0, 1.0 + 1e-9, 2.0, 2.0 + 1e-9]  # each probe once
    assert [t for t, _ in samples["w0"]] == [0.0, 1.0, 2.0, 3.0]  # at the first step that carries it
    assert reference_pace(steps) == pytest.approx(2.0)  # the median of six probes
    paces = step_paces(steps, smooth_s=0.6)
    assert paces[0] == pytest.approx(1.0) and paces[6] == pytest.approx(2.0)  # its own worker's probes only
    assert paces[8] == pytest.approx(3.0)
    assert step_paces(steps, smooth_s=10.0)[0] == pytest.approx(1.5)  # the median over the whole worker
    priced = at_reference_pace(steps, 2.0, smooth_s=0.6)
    assert priced[0].cpu_s == pytest.approx(0.16) and priced[6].cpu_s == pytest.approx(0.08)
    assert priced[0].duration_s == steps[0].duration_s  # the wall clock is left as it is
    assert pace_recorded(steps) and not pace_recorded([*steps, StepStats(9.0, 0.1)])
    with pytest.raises(ValueError, match="pace probe"):
        reference_pace([StepStats(0.0, 0.1)])
    with pytest.raises(ValueError, match="reference"):
        at_reference_pace(steps, 0.0)
