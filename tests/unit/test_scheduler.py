"""The scheduler and block manager, driven without torch or a model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.block_manager import BlockManager, compute_block_hashes
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 16


def make(budget=64, seqs=8, blocks=64, chunked=True, cap=None, prefix=True, max_len=4096):
    bm = BlockManager(blocks, BS, enable_prefix_caching=prefix)
    config = SchedulerConfig(budget, seqs, max_len, enable_chunked_prefill=chunked, max_chunk_tokens=cap)
    return Scheduler(config, bm), bm


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(rid, [(base + i) % 250 for i in range(n)], SamplingParams(max_tokens=max_tokens))


def fake_step(s: Scheduler) -> SchedulerOutput:
    """Schedule, 'compute', append token 7 for every sampling chunk, finish at max_tokens."""
    out = s.schedule()
    s.update_after_step(out)
    for c in out.chunks:
        r = s.requests[c.request_id]
        if c.samples:
            r.all_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, FinishReason.LENGTH)
    return out


def run_all(s: Scheduler, limit: int = 10_000) -> list[SchedulerOutput]:
    steps = []
    while s.has_unfinished():
        steps.append(fake_step(s))
        assert len(steps) < limit, "scheduler made no progress"
    return steps


def test_scheduler_module_has_no_torch():
    code = "import sys, pdserve.engine.scheduler, pdserve.engine.block_manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_budget_and_sequence_cap_respected():
    s, bm = make(budget=40, seqs=3, blocks=200)
    for i in range(10):
        s.add(req(f"r{i}", 25 + i * 3, max_tokens=5))
    for out in run_all(s):
        assert out.num_tokens <= 40
        assert len(out.chunks) <= 3
        assert len(s.running) <= 3
    bm.check_integrity()
    assert bm.usage().used == 0


def test_decodes_first_then_partial_prefills_then_waiting_in_arrival_order():
    s, _ = make(budget=50, seqs=8, blocks=200, prefix=False)
    s.add(req("a", 10, max_tokens=20))
    s.add(req("b", 10, max_tokens=20))
    fake_step(s)  # a and b prefill whole and sample their first token
    s.add(req("long", 60, max_tokens=2))
    s.add(req("c", 5, max_tokens=2))
    out = fake_step(s)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in out.chunks] == [
        ("a", 10, 1),
        ("b", 10, 1),
        ("long", 0, 48),
    ]  # c waits: the budget is spent
    out = fake_step(s)
    # running decodes, then the partially prefilled request, then the waiting one
    assert [(c.request_id, c.start, len(c.token_ids), c.samples) for c in out.chunks] == [
        ("a", 11, 1, True),
        ("b", 11, 1, True),
        ("long", 48, 12, True),
        ("c", 0, 5, True),
    ]


def test_arrival_order_and_exact_chunks():
    s, _ = make(budget=32, seqs=8, blocks=200, prefix=False)
    s.add(req("first", 40, max_tokens=1))
    s.add(req("second", 20, max_tokens=1))
    out = fake_step(s)
    assert [(c.request_id, c.start, len(c.token_ids)) for c in out.chunks] == [("first", 0, 32)]
    out = fake_step(s)
    assert [(c.request_id, c.start, len(c.token_ids), c.samples) for c in out.chunks] == [
        ("first", 32, 8, True),
        ("second", 0, 20, True),
    ]


def test_prompt_longer_than_budget_completes_over_several_steps():
    s, bm = make(budget=16, seqs=4, blocks=100)
    s.add(req("long", 300, max_tokens=3))
    steps = run_all(s)
    prefill_steps = [o for o in steps if o.chunks and not o.chunks[0].samples]
    assert len(prefill_steps) == 300 // 16  # 18 full chunks, the 19th (12 tokens) samples
    assert all(o.num_tokens <= 16 for o in steps)
    bm.check_integrity()


def test_per_request_chunk_cap():
    s, _ = make(budget=100, seqs=4, blocks=100, cap=30)
    s.add(req("a", 70))
    s.add(req("b", 70, base=100))
    out = fake_step(s)
    assert [len(c.token_ids) for c in out.chunks] == [30, 30]


def test_unchunked_prefill_runs_whole_or_waits():
    s, _ = make(budget=64, seqs=4, blocks=100, chunked=False, prefix=False)
    s.add(req("a", 40))
    s.add(req("b", 40, base=50))
    out = fake_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 40)]  # b does not fit: waits
    out = fake_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 40)]


def test_preemption_frees_newest_and_everything_completes():
    # 6 blocks of 16 slots: two 40-token prompts growing to 60 tokens cannot both stay resident
    s, bm = make(budget=128, seqs=4, blocks=6, prefix=False)
    s.add(req("old", 40, max_tokens=20))
    s.add(req("new", 40, max_tokens=20, base=60))
    steps = run_all(s)
    preempted = [rid for o in steps for rid in o.preempted]
    assert preempted and set(preempted) == {"new"}
    bm.check_integrity()
    assert bm.usage().used == 0


def test_a_request_is_preempted_at_most_once_per_step():
    # 4 blocks of 4 slots: a 12-token prompt prefilled 4 tokens a step, next to two 3-token requests.
    # Once the short ones decode past their first block, blocks run out: a request preempted earlier in
    # the step must not allocate again (and evict another request for its own sake).
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(64, 8, 64, max_chunk_tokens=4), bm)
    s.add(Request("P", list(range(12)), SamplingParams(max_tokens=2)))
    s.add(Request("r1", [20, 21, 22], SamplingParams(max_tokens=6)))
    s.add(Request("r2", [30, 31, 32], SamplingParams(max_tokens=6)))
    steps = run_all(s)
    for out in steps:
        assert len(out.preempted) == len(set(out.preempted)), out.preempted
        scheduled = {c.request_id for c in out.chunks}
        assert not scheduled & set(out.preempted), (scheduled, out.preempted)
        bm.check_integrity()
    assert any(out.preempted for out in steps)
    assert bm.usage().used == 0


def test_prefix_hit_skips_exactly_the_cached_full_blocks():
    s, bm = make(budget=256, seqs=4, blocks=64)
    shared = list(range(50))  # 3 full blocks + 2 tokens
    first = Request("first", shared + [200, 201], SamplingParams(max_tokens=1))
    s.add(first)
    first_blocks = fake_step(s).chunks[0].block_ids
    run_all(s)
    second = Request("second", shared + [210, 211, 212], SamplingParams(max_tokens=1))
    s.add(second)
    out = fake_step(s)
    assert second.num_cached_tokens == 48
    assert out.chunks[0].start == 48 and len(out.chunks[0].token_ids) == 53 - 48
    assert out.chunks[0].block_ids[:3] == first_blocks[:3]  # the very same blocks, shared
    # a prompt that is exactly cached still recomputes its last token (logits are needed)
    third = Request("third", list(range(48)), SamplingParams(max_tokens=1))
    s.add(third)
    out = fake_step(s)
    assert third.num_cached_tokens == 32 and out.chunks[0].start == 32
    run_all(s)
    bm.check_integrity()
    assert bm.usage().used == 0 and bm.usage().cached > 0


def test_block_hashes_are_chained_and_stable():
    a = compute_block_hashes(list(range(40)), BS)
    b = compute_block_hashes(list(range(40)), BS)
    assert a == b and len(a) == 2
    c = compute_block_hashes([99] + list(range(1, 40)), BS)
    assert c[0] != a[0] and c[1] != a[1]  # same tokens in block 1, different parent
    # stable across processes (Python's hash() is salted; ours must not be)
    code = "from pdserve.engine.block_manager import compute_block_hashes as h; print(h(list(range(40)), 16)[1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == a[1].hex()


def test_lru_eviction_of_cached_blocks():
    bm = BlockManager(4, BS)
    r1 = req("r1", 32)
    assert bm.allocate_slots(r1, 32)
    r1.num_computed_tokens = 32
    bm.cache_full_blocks(r1)
    bm.free(r1)
    assert bm.usage() == (4, 2, 2, 0)
    r2 = req("r2", 48, base=100)
    assert bm.allocate_slots(r2, 48)  # takes both free blocks, then evicts one cached block
    assert bm.usage() == (4, 0, 1, 3)
    bm.free(r2)
    bm.check_integrity()
    hit = bm.find_prefix_hit(req("r3", 40))
    assert hit.num_tokens in (0, 16)  # r1's tail block was evicted first; its head may survive
    bm.check_integrity()


def test_abort_and_finish_leave_no_leak():
    s, bm = make(budget=32, seqs=4, blocks=40)
    for i in range(6):
        s.add(req(f"r{i}", 30 + i, max_tokens=10, base=i * 13))
    fake_step(s)
    fake_step(s)
    s.finish(s.requests["r1"], FinishReason.ABORT)  # running
    s.finish(s.requests["r5"], FinishReason.ABORT)  # waiting
    run_all(s)
    bm.check_integrity()
    assert bm.usage().used == 0


def test_duplicate_request_id_rejected():
    s, _ = make()
    s.add(req("x", 5))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("x", 5))
    assert s.requests["x"].status == RequestStatus.WAITING


def test_each_request_knows_the_step_count_at_which_it_was_queued_and_a_stall_is_not_a_step():
    from pdserve.engine import remote_kv

    s, _ = make(budget=64, blocks=8)
    a = req("a", 100, max_tokens=2)
    s.add(a)
    assert a.queued_at_step == 0 and s.num_steps == 0
    fake_step(s)  # a's first chunk
    fake_step(s)
    b = req("b", 16, base=100)
    s.add(b)
    assert (s.num_steps, b.queued_at_step) == (2, 2)
    first_b = next(k for k in range(2, 10) if any(c.request_id == "b" for c in fake_step(s).chunks))
    assert first_b == b.queued_at_step  # the step of that count is the first that could take it, and did
    too_long = req("t", 200, base=50)  # 13 blocks of the 8
    assert remote_kv.reserve_remote_blocks(s, too_long, 0.0) is None and too_long.reserved_at_step == -1
    remote = req("r", 100, base=50)
    while s.has_unfinished():
        fake_step(s)
    steps = s.num_steps
    assert not s.schedule().chunks and s.num_steps == steps  # nothing to schedule: not a step
    assert remote_kv.reserve_remote_blocks(s, remote, 0.0) == 0
    assert remote.reserved_at_step == steps and remote.queued_at_step == -1
    assert remote_kv.admit_remote(s, remote, 7, 0.0, 4096) is None
    assert remote.queued_at_step == steps


def test_update_from_output_appends_tokens_applies_the_stop_rule_and_keeps_held_blocks():
    s, bm = make(budget=64, max_len=4096)
    s.add(req("long", 20, max_tokens=3))
    s.add(req("eos", 10, max_tokens=8))
    s.add(req("held", 12, max_tokens=1))
    s.add(req("aborted", 5, max_tokens=4))
    s.requests["eos"].eos_token_ids = (99,)
    out = s.schedule()
    assert all(c.samples for c in out.chunks)
    s.finish(s.requests["aborted"], FinishReason.ABORT)  # while the step ran: its token is dropped
    tokens = {"long": 7, "eos": 99, "held": 5, "aborted": 3}
    updates = s.update_from_output(out, tokens, now=2.0, keep_blocks={"held"})
    assert [(u.request.request_id, u.token, u.finish_reason) for u in updates] == [
        ("long", 7, None),
        ("eos", 99, FinishReason.STOP),
        ("held", 5, FinishReason.LENGTH),
    ]
    long = s.requests["long"]
    assert long.num_computed_tokens == 20 and long.output_token_ids == [7] and long.times.first_token == 2.0
    assert set(s.requests) == {"long"}
    held = updates[2].request
    assert held.is_finished and held.block_ids  # its blocks stay until the caller frees them
    assert not updates[1].request.block_ids
    bm.free(held)
    s.finish(long, FinishReason.ABORT)
    bm.check_integrity()
