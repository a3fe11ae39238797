"""The simulator's engine-loop timing (what trace replay found) and trace replay itself (``pdserve.sim.replay``)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.sim.cost_model import RooflineCostModel
from pdserve.sim.profiles import get_hardware, get_model
from pdserve.sim.replay import replay, replay_simulated
from pdserve.sim.simulator import SimConfig, simulate
from pdserve.workload.generator import WorkloadRequest, WorkloadSpec, build_workload

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


@pytest.mark.parametrize(
    ("mode", "counts"),
    [("colocated", {"num_instances": 2}), ("disaggregated", {"num_prefill": 1, "num_decode": 2})],
)
def test_replaying_a_simulated_run_reproduces_it_exactly(mode, counts):
    # latencies around the steps and a co-run slowdown: the recorded durations carry the slowdown, the
    # replay must not add it again
    cfg = SimConfig(
        max_num_batched_tokens=512,
        chunk_size=256,
        control_latency_s=0.4e-3,
        token_latency_s=0.2e-3,
        step_gap_s=0.1e-3,
        co_run_slowdown=0.3,
        step_tail=False,
        kv_link_bw=5e9,
        kv_link_latency_s=50e-6,
    )
    reqs = build_workload(WorkloadSpec(num_requests=60, rate=30.0, prompt_len_mean=400, output_len_mean=24, seed=5))
    original = simulate(reqs.requests, H100_8B, cfg, mode=mode, **counts)
    # the replay's config knows no loop gap: the recorded gaps between back-to-back steps stand in for it
    report = replay_simulated(original, reqs.requests, H100_8B, dataclasses.replace(cfg, step_gap_s=0.0), counts)
    replayed = report.result
    assert report.step_agreement == 1.0 and report.num_steps == len(original.steps) > 100
    assert report.unreplayed_steps == 0
    assert replayed.step_chunks == original.step_chunks
    for a, b in zip(replayed.steps, original.steps, strict=True):
        assert (a.worker, a.num_prefill_tokens, a.num_decode_tokens) == (
            b.worker,
            b.num_prefill_tokens,
            b.num_decode_tokens,
        )
        assert a.started == pytest.approx(b.started, abs=1e-9) and a.duration_s == pytest.approx(b.duration_s, abs=1e-9)
    for a, b in zip(replayed.records, original.records, strict=True):
        assert a.request_id == b.request_id and a.token_times == pytest.approx(b.token_times, abs=1e-9)
    assert report.passed and all(abs(report.error(f)) < 1e-9 for f in ("TTFT p50", "ITL p50", "TTFT p99"))
    # every admission's recorded step count is the one its replayed timeline reaches: nothing to move
    alignment = report.alignment
    assert alignment["events"] >= len(reqs.requests) and alignment["on_time"] == alignment["events"]


def test_a_replay_follows_the_recorded_routes_and_reports_how_often_the_policy_differs():
    # two requests sent at once: the real router happened to receive b first, so a went to decode-1 and b to
    # decode-0; the replay's policy (a first) would send a to decode-0, which the replay reports and does not do
    cfg = SimConfig(chunk_size=256, kv_link_bw=5e9, kv_link_latency_s=50e-6, step_tail=False, control_latency_s=1e-3)
    reqs = [_req("a", 300, 4, 0.0), _req("b", 40, 4, 0.0)]
    original = simulate(reqs, H100_8B, cfg, num_instances=2)
    assert {r.request_id: r.meta["decode_worker"] for r in original.records} == {"a": "decode-0", "b": "decode-1"}
    swap = {"decode-0": "decode-1", "decode-1": "decode-0"}
    records = [
        dataclasses.replace(r, meta={**r.meta, "decode_worker": swap[r.meta["decode_worker"]]})
        for r in original.records
    ]
    steps = [s._replace(worker=swap[s.worker]) for s in original.steps]
    chunks = list(original.step_chunks)
    report = replay(reqs, records, steps, H100_8B, cfg, num_instances=2, compositions=chunks, time_origin=0.0)
    # a is routed as recorded; b, on a view that holds a where it really went, goes where it went by itself
    assert report.rerouted == 1 and report.routing_agreement == 0.5
    assert report.step_agreement == 1.0
    assert {r.request_id: r.meta["decode_worker"] for r in report.result.records} == {"a": "decode-1", "b": "decode-0"}
    same = replay(reqs, original.records, original.steps, H100_8B, cfg, num_instances=2, time_origin=0.0)
    assert same.routing_agreement == 1.0 and same.step_agreement == 1.0


def test_replay_reports_disagreement_and_bad_traces():
    cfg = SimConfig(chunk_size=256, kv_link_bw=5e9, kv_link_latency_s=50e-6, step_tail=False)
    reqs = build_workload(WorkloadSpec(num_requests=20, rate=20.0, prompt_len_mean=600, output_len_mean=10, seed=1))
    original = simulate(reqs.requests, H100_8B, cfg)
    # the same trace with every step twice as long: requests pile up differently, so steps diverge
    slow = [s._replace(duration_s=2 * s.duration_s) for s in original.steps]
    report = replay(reqs.requests, original.records, slow, H100_8B, cfg, time_origin=0.0)
    assert report.step_agreement < 1.0 and report.mismatches
    assert report.replayed["TTFT p50"] > report.recorded["TTFT p50"]
    with pytest.raises(ValueError, match="workers decode-1"):
        replay(reqs.requests, original.records, [s._replace(worker="decode-1") for s in original.steps], H100_8B, cfg)
    with pytest.raises(ValueError, match="no record of request"):
        replay([*reqs.requests, _req("z", 10, 2, 0.0)], original.records, original.steps, H100_8B, cfg)


def test_a_request_that_found_its_worker_idle_reaches_it_after_its_recorded_call_latency():
    from pdserve.messages import StepStats
    from pdserve.workload.metrics import RequestRecord

    # measured: "a" sent at 100.0 reached the idle worker 20 ms later (its prefill step began then, no queue);
    # "b", sent while that step ran, was taken in only after it: its call's latency is not on record
    steps = [StepStats(100.020, 0.05, num_prefill_tokens=300, num_seqs=1, worker="decode-0")]
    steps += [StepStats(100.070 + 0.01 * k, 0.01, num_decode_tokens=1, num_seqs=1, worker="decode-0") for k in range(2)]
    meta = {"decode_worker": "decode-0", "prefill_worker": "", "queue_s": 0.0, "prefill_s": 0.05}
    records = [
        RequestRecord("a", 100.0, (100.071, 100.081, 100.091), 300, meta=meta),
        RequestRecord("b", 100.030, (100.2,), 64, meta={**meta, "queue_s": 0.04, "prefill_s": 0.1}),
    ]
    requests = [_req("a", 300, 3, 0.0), _req("b", 64, 1, 0.03)]
    report = replay(
        requests, records, steps, H100_8B, SimConfig(control_latency_s=1e-3, kv_link_bw=5e9, kv_link_latency_s=0)
    )
    first = report.result.steps[0]
    assert first.started == pytest.approx(0.020) and first.num_prefill_tokens == 300
    b_step = next(s for s in report.result.steps if s.num_prefill_tokens == 64)
    assert b_step.started == pytest.approx(first.ended)  # at the config's 1 ms it arrived during a's prefill


def test_a_request_that_found_its_worker_busy_reaches_it_when_the_worker_says_it_did():
    from pdserve.messages import StepStats
    from pdserve.workload.metrics import RequestRecord

    # measured: "b", sent during a's prefill, reached the busy worker only at 100.075 (its decode_call_time),
    # during a's first decode, and was prefilled in the step after that one, not in the step after the prefill
    steps = [StepStats(100.020, 0.05, num_prefill_tokens=300, num_seqs=1, worker="decode-0")]
    steps.append(StepStats(100.070, 0.01, num_decode_tokens=1, num_seqs=1, worker="decode-0"))
    steps.append(StepStats(100.080, 0.02, num_prefill_tokens=64, num_decode_tokens=1, num_seqs=2, worker="decode-0"))
    meta = {"decode_worker": "decode-0", "prefill_worker": "", "queue_s": 0.0, "prefill_s": 0.05}
    a = RequestRecord("a", 100.0, (100.071, 100.081, 100.101), 300, meta=meta)
    requests = [_req("a", 300, 3, 0.0), _req("b", 64, 1, 0.03)]
    config = SimConfig(control_latency_s=1e-3, kv_link_bw=5e9, kv_link_latency_s=0)

    def b_step_start(b_meta):
        b = RequestRecord("b", 100.030, (100.101,), 64, meta={**meta, "prefill_s": 0.02, **b_meta})
        report = replay(requests, [a, b], steps, H100_8B, config)
        return next(s for s in report.result.steps if s.num_prefill_tokens == 64).started

    assert b_step_start({"decode_call_time": 100.075}) == pytest.approx(0.080)
    assert b_step_start({}) == pytest.approx(0.070)  # without it: the config's 1 ms, and b joins one step early


def _boundary_trace(b_sent: float, b_queued_at: int):
    """A worker's recorded steps: a's prefill, a's first decode, then a's decode with b's prompt. a's prefill
    runs from 0.001 to 0.051 on the replay's clock; b's call reaches the worker 1 ms after b is sent (the
    config's latency); the run recorded the step count at which b was queued."""
    from pdserve.messages import StepStats
    from pdserve.workload.metrics import RequestRecord

    steps = [StepStats(100.0, 0.05, num_prefill_tokens=300, num_seqs=1, worker="decode-0")]
    steps.append(StepStats(100.05, 0.01, num_decode_tokens=1, num_seqs=1, worker="decode-0"))
    both = {"num_prefill_tokens": 64, "num_decode_tokens": 1, "num_seqs": 2}
    steps.append(StepStats(100.06, 0.02, **both, worker="decode-0"))
    meta = {"decode_worker": "decode-0", "prefill_worker": ""}
    a = RequestRecord("a", 99.999, (100.051, 100.061, 100.081), 300, meta={**meta, "decode_queued_step": 0})
    b = RequestRecord("b", 100 + b_sent, (100.081,), 64, meta={**meta, "decode_queued_step": b_queued_at})
    requests = [_req("a", 300, 3, 0.0), _req("b", 64, 1, b_sent + 0.001)]
    return requests, [a, b], steps


@pytest.mark.parametrize(("window_s", "aligned"), [(0.005, True), (0.002, False), (0.0, False)])
def test_an_admission_just_before_a_step_boundary_joins_the_step_the_run_recorded(window_s, aligned):
    # b's call reaches the worker at 0.048 in the replay, 3 ms before a's prefill ends: the replayed timeline
    # puts it in step 1, the run recorded it queued at 2 (its call took a few ms longer there)
    requests, records, steps = _boundary_trace(0.046, 2)
    cfg = SimConfig(control_latency_s=1e-3, kv_link_bw=5e9, kv_link_latency_s=0)
    report = replay(requests, records, steps, H100_8B, cfg, time_origin=99.999, tie_window_s=window_s)
    b_step = next(k for k, s in enumerate(report.result.steps) if s.num_prefill_tokens == 64)
    assert b_step == (2 if aligned else 1)
    shapes = [(s.num_prefill_tokens, s.num_decode_tokens) for s in report.result.steps]
    assert shapes == ([(300, 0), (0, 1), (64, 1)] if aligned else [(300, 0), (64, 1), (0, 1)])
    assert report.alignment["moved"] == (1 if aligned else 0) and report.alignment["off"] == (0 if aligned else 1)
    if aligned:
        assert report.alignment["moved_max_ms"] == pytest.approx(3.0, abs=0.01)


@pytest.mark.parametrize(("window_s", "aligned"), [(0.005, True), (0.0, False)])
def test_a_step_waits_for_an_admission_the_run_recorded_for_it_that_comes_just_after_it_would_start(window_s, aligned):
    # b's call reaches the worker at 0.052 in the replay, 1 ms after step 1 would start; the run had b queued
    # before it (at 1): within the window the step waits for b, and starts 1 ms late
    requests, records, steps = _boundary_trace(0.050, 1)
    cfg = SimConfig(control_latency_s=1e-3, kv_link_bw=5e9, kv_link_latency_s=0)
    report = replay(requests, records, steps, H100_8B, cfg, time_origin=99.999, tie_window_s=window_s)
    second = report.result.steps[1]
    if aligned:
        assert second.num_prefill_tokens == 64 and second.started == pytest.approx(0.052)
        assert report.alignment["moved_max_ms"] == pytest.approx(1.0, abs=0.01)
    else:
        assert second.num_prefill_tokens == 0 and second.started == pytest.approx(0.051)
        assert report.alignment["off"] == 1


def test_a_handoff_to_a_busy_decode_worker_is_read_off_the_decode_call_time():
    from pdserve.messages import StepStats
    from pdserve.sim.calibrate import recorded_handoff_latencies
    from pdserve.workload.metrics import RequestRecord

    # the decode worker was stepping (another request) when r's first token came at 100.05: its decode call
    # reached it at 100.062, and it took r in after the step that ended at 100.07
    steps = [StepStats(100.0, 0.05, num_prefill_tokens=64, num_seqs=1, worker="prefill-0")]
    steps += [StepStats(100.03 + 0.02 * k, 0.02, num_decode_tokens=1, num_seqs=1, worker="decode-0") for k in range(4)]
    meta = {"decode_worker": "decode-0", "prefill_worker": "prefill-0", "queue_s": 0.0, "prefill_s": 0.05}
    meta["second_token_time"] = 100.09
    record = RequestRecord("r", 99.99, (100.052, 100.091), 64, meta=meta)
    assert recorded_handoff_latencies(steps, [record]) == {}  # busy, and no call time: not on record
    timed = RequestRecord("r", 99.99, (100.052, 100.091), 64, meta={**meta, "decode_call_time": 100.062})
    assert recorded_handoff_latencies(steps, [timed]) == {"r": pytest.approx(0.012)}


def test_a_first_token_received_just_before_its_steps_recorded_end_is_that_steps():
    from pdserve.messages import StepStats
    from pdserve.sim.calibrate import recorded_handoff_latencies
    from pdserve.workload.metrics import RequestRecord

    # as in a measured run: the prefill worker's second 256-token chunk is recorded as ending at 13.2759, 0.5 ms
    # after the client received the token it sampled; the idle decode worker began the step that sampled
    # token #2 at 13.2781. The handoff is 2.2 ms, not the 288 ms since the first chunk's end
    steps = [
        StepStats(12.6115, 0.3764, num_prefill_tokens=256, num_seqs=1, worker="prefill-0"),
        StepStats(13.0004, 0.2755, num_prefill_tokens=256, num_seqs=1, worker="prefill-0"),
        StepStats(13.2781, 0.0647, num_decode_tokens=1, num_seqs=1, worker="decode-0"),
    ]
    meta = {"decode_worker": "decode-0", "prefill_worker": "prefill-0", "queue_s": 0.0, "prefill_s": 0.66}
    meta |= {"second_token_time": 13.3429, "decode_call_time": 13.2779}
    record = RequestRecord("r", 12.6, (13.2754, 13.3439), 512, meta=meta)
    assert recorded_handoff_latencies(steps, [record]) == {"r": pytest.approx(0.0022, abs=1e-4)}


def test_prefill_admission_stays_on_the_last_ticks_count_while_the_loop_works_after_a_step():
    # six 64-token prompts at once, budget 256: the first starts a step alone, three more are admitted during it
    # (64 + 192 = 256). After the step, the loop pushes its KV before its next tick (a 10 ms gap): the admission
    # rule still reads the last tick's count, so no fourth prompt slips in through the gap's quick round trip
    cfg = SimConfig(
        max_num_batched_tokens=256,
        chunk_size=256,
        control_latency_s=0.2e-3,
        reserve_latency_s=0.5e-3,
        step_gap_s=0.01,
        kv_link_bw=5e9,
        kv_link_latency_s=50e-6,
    )
    reqs = [_req(f"s{i}", 64, 2, 0.0) for i in range(6)]
    res = simulate(reqs, H100_8B, cfg, mode="disaggregated")
    sizes = [len(chunks) for chunks in _chunks_of(res, "prefill-0")]
    assert sizes[:2] == [1, 3] and sum(sizes) == 6


def test_a_request_handed_to_an_idle_decode_worker_takes_its_recorded_handoff():
    from pdserve.messages import StepStats
    from pdserve.workload.metrics import RequestRecord

    # measured: the prefill worker took "r" in 10 ms after its send and prefilled it at once; the idle decode
    # worker began the step that sampled its second token 30 ms after the prefill step's end
    steps = [StepStats(100.0, 0.05, num_prefill_tokens=64, num_seqs=1, worker="prefill-0")]
    steps += [StepStats(100.08 + 0.02 * k, 0.02, num_decode_tokens=1, num_seqs=1, worker="decode-0") for k in range(2)]
    meta = {"decode_worker": "decode-0", "prefill_worker": "prefill-0", "queue_s": 0.0, "prefill_s": 0.05}
    record = RequestRecord("r", 99.99, (100.052, 100.101, 100.121), 64, meta={**meta, "second_token_time": 100.1})
    config = SimConfig(control_latency_s=1e-3, reserve_latency_s=0.0, handoff_latency_s=5e-3, kv_link_bw=5e9)
    config = dataclasses.replace(config, kv_link_latency_s=0.0)
    report = replay([_req("r", 64, 3, 0.0)], [record], steps, H100_8B, config, mode="disaggregated")
    prefill, decode = report.result.steps_of("prefill-0")[0], report.result.steps_of("decode-0")[0]
    assert prefill.started == pytest.approx(0.010) and prefill.ended == pytest.approx(0.060)
    assert decode.started == pytest.approx(0.090)  # not the config's 5 ms


def test_calls_that_reach_a_prefill_worker_together_keep_the_order_its_records_show():
    # a, b and c reach the prefill worker 1 ms apart; the run's workers took c in before b (the real router
    # and worker saw them in another order than sent): the replay's FIFO follows the record, not the send order
    cfg = SimConfig(
        max_num_batched_tokens=256, chunk_size=256, control_latency_s=1e-3, kv_link_bw=5e9, kv_link_latency_s=0
    )
    reqs = [_req("a", 300, 2, 0.0), _req("b", 300, 2, 0.001), _req("c", 260, 2, 0.002)]
    original = simulate(reqs, H100_8B, cfg, mode="disaggregated")
    first_chunks = [c for chunks in _chunks_of(original, "prefill-0") for c in chunks if c[0] != "a"]
    assert list(dict.fromkeys(rid for rid, _ in first_chunks)) == ["b", "c"]
    meta = {r.request_id: r.meta for r in original.records}
    assert meta["b"]["prefill_queued_step"] < meta["c"]["prefill_queued_step"]  # one admitted per step
    swapped = {"b": "c", "c": "b"}
    events = ("prefill_queued_step", "decode_reserved_step", "decode_queued_step")
    records = [
        dataclasses.replace(r, meta={**r.meta, **{e: meta[swapped[r.request_id]][e] for e in events}})
        if r.request_id in swapped
        else r
        for r in original.records
    ]
    for window, order in ((0.005, ["c", "b"]), (0.0, ["b", "c"])):
        report = replay(
            reqs, records, original.steps, H100_8B, cfg, mode="disaggregated", time_origin=0.0, tie_window_s=window
        )
        chunks = [c for step in _chunks_of(report.result, "prefill-0") for c in step if c[0] != "a"]
        assert list(dict.fromkeys(rid for rid, _ in chunks)) == order, window
