"""The engine's scheduling policies run the same in the real engine and in the simulator."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import StepShape
from pdserve.sim.cost_profile import ProfileModel
from pdserve.sim.simulator import simulate
from pdserve.workload.generator import WorkloadRequest

BUDGET, SEQS, BLOCKS = 160, 12, 256


class OneSecondSteps:
    """Every step lasts one second, whatever it holds: the simulator's steps fall on a grid of whole seconds."""

    name = "one second a step"
    kv_bytes_per_token = 1
    model = ProfileModel("tiny", 1, 4096)

    def step_time(self, shape: StepShape, role: str = "colocated") -> float:
        return 1.0

    def kv_capacity_tokens(self) -> int:
        return BLOCKS * 16


def _workload(seed: int = 3) -> list[WorkloadRequest]:
    """A long-running request from 0 s, then prompts arriving mid-step (k + 0.5 s) while it decodes."""
    rng = random.Random(seed)
    out = [WorkloadRequest("r0", [rng.randrange(256) for _ in range(40)], 60, 0.0)]
    t = 0.5
    for i in range(1, 14):
        t += rng.choice((0.0, 1.0, 2.0, 3.0))
        prompt = [rng.randrange(256) for _ in range(rng.randint(20, 130))]
        out.append(WorkloadRequest(f"r{i}", prompt, rng.randint(2, 12), t))
    return out


def _engine_steps(workload: list[WorkloadRequest], scheduling: str) -> list[tuple[tuple[str, int], ...]]:
    """The real engine (tiny preset) stepped with each request added before the step after its arrival."""
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            num_kv_blocks=BLOCKS,
            max_model_len=1024,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=SEQS,
            scheduling=scheduling,
        )
    )
    pending = sorted(workload, key=lambda w: w.arrival_offset_s)
    steps = []
    k = 0  # steps run so far: the simulator's step k + 1 runs from k to k + 1 s
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_offset_s < max(k, 0.25):  # arrived by the end of the running step
            w = pending.pop(0)
            params = SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(w.prompt_token_ids, params, request_id=w.request_id)
        engine.step()
        assert engine.last_output is not None
        steps.append(tuple((c.request_id, len(c.token_ids)) for c in engine.last_output.chunks))
        k += 1
    return steps


@pytest.mark.parametrize("scheduling", ["mixed", "prefill-first"])
def test_engine_and_simulator_agree_on_every_steps_composition(scheduling):
    workload = _workload()
    config = SimConfig(
        num_kv_blocks=BLOCKS,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=SEQS,
        scheduling=scheduling,
        kv_link_bw=1e9,
        kv_link_latency_s=0.0,
    )
    simulated = simulate(workload, OneSecondSteps(), config)
    assert [s.started for s in simulated.steps] == [float(k) for k in range(len(simulated.steps))]  # never idle
    real = _engine_steps(workload, scheduling)
    assert list(simulated.step_chunks) == real
    mixed_steps = [s for s in simulated.steps if s.num_prefill_tokens and s.num_decode_tokens]
    assert bool(mixed_steps) == (scheduling == "mixed")  # the workload exercises the difference
