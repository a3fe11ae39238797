"""The simulator's engine-loop timing (what trace replay found) and trace replay itself (``pdserve.sim.replay``)."""

from __future__ import annotations

from pdserve.bench.workloads import WorkloadRequest
from pdserve.sim.cost_model import RooflineCostModel
from pdserve.sim.profiles import get_hardware, get_model
from pdserve.sim.simulator import SimConfig, simulate

H100_8B = RooflineCostModel(get_hardware("H100"), get_model("Llama-3-8B"))


def _req(rid: str, prompt_len: int, max_tokens: int, at: float) -> WorkloadRequest:
    return WorkloadRequest(rid, [(7 * i + 31 * ord(rid[0])) % 250 + 1 for i in range(prompt_len)], max_tokens, at)


def _chunks_of(result, worker):
    return [chunks for step, chunks in zip(result.steps, result.step_chunks, strict=True) if step.worker == worker]


def test_an_idle_instance_starts_on_the_first_request_of_a_simultaneous_pair():
    # the engine loop wakes on the first command and steps before the second call arrives
    reqs = [_req("a", 300, 3, 0.0), _req("b", 200, 3, 0.0)]
    res = simulate(reqs, H100_8B, SimConfig(control_latency_s=1e-3))
    steps = _chunks_of(res, "decode-0")
    assert steps[0] == (("a", 300),)
    assert steps[1] == (("a", 1), ("b", 200))  # b joins the next step, next to a's first decode


def test_prefill_admission_reads_the_waiting_tokens_of_the_loops_last_tick():
    # a 1024-token prompt waits when step 1 begins (budget 512, chunks of 256): while that step runs the worker's
    # admission rule still counts it, so a short prompt arriving meanwhile is admitted only after the
    # step, and its reservation round trip makes it miss step 2 as well
    cfg = SimConfig(max_num_batched_tokens=512, chunk_size=256, control_latency_s=0.5e-3)
    reqs = [_req("long", 1024, 2, 0.0), _req("short", 64, 2, 0.003)]
    res = simulate(reqs, H100_8B, cfg, mode="disaggregated")
    steps = _chunks_of(res, "prefill-0")
    assert steps[0] == (("long", 256),) and steps[1] == (("long", 256),)
    first_step_end = res.steps_of("prefill-0")[0].ended
    assert reqs[1].arrival_offset_s < first_step_end
    assert ("short", 64) in steps[2]
