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


def make(budget=64, seqs=8, blocks=64, chunked=True, cap=None, prefix=True, max_len=4096, scheduling="mixed"):
    bm = BlockManager(blocks, BS, enable_prefix_caching=prefix)
    config = SchedulerConfig(
        budget, seqs, max_len, enable_chunked_prefill=chunked, max_chunk_tokens=cap, scheduling=scheduling
    )
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


def test_a_stalled_schedule_is_not_a_step():
    s, _ = make(budget=64, blocks=8)
    s.add(req("a", 100, max_tokens=2))
    fake_step(s)
    fake_step(s)
    while s.has_unfinished():
        fake_step(s)
    steps = s.num_steps
    assert not s.schedule().chunks and s.num_steps == steps  # nothing to schedule: not a step


def _kinds(out: SchedulerOutput) -> str:
    if out.num_prefill_tokens and out.num_decode_tokens:
        return "mixed"
    return "prefill" if out.num_prefill_tokens else "decode"


@pytest.mark.parametrize("chunked", [True, False])
def test_prefill_first_runs_new_prompts_in_steps_of_their_own_while_decodes_wait(chunked):
    steps = {}
    for policy in ("mixed", "prefill-first"):
        s, bm = make(budget=80, seqs=8, blocks=200, chunked=chunked, scheduling=policy)
        s.add(req("a", 20, max_tokens=6))
        s.add(req("b", 20, max_tokens=6, base=30))
        outs = [fake_step(s), fake_step(s)]  # a and b's prompts, then a decode
        s.add(req("c", 50, max_tokens=3, base=60))  # arrives while a and b decode
        s.add(req("d", 25, max_tokens=3, base=90))
        outs += run_all(s)
        steps[policy] = outs
        bm.check_integrity()
    mixed, first = steps["mixed"], steps["prefill-first"]
    assert any(_kinds(o) == "mixed" for o in mixed)  # mixed: the new prompts share steps with a and b's decodes
    assert all(_kinds(o) != "mixed" for o in first)  # prefill-first: never
    assert [_kinds(o) for o in first[:3]] == ["prefill", "decode", "prefill"]
    assert {c.request_id for c in first[2].chunks} == {"c", "d"}  # both waiting prompts in one prompt-only step
    assert {c.request_id for c in first[3].chunks} == {"a", "b", "c", "d"}  # then everyone decodes together
    # the same work either way: every request computed every token once
    for policy, outs in steps.items():
        assert sum(o.num_tokens for o in outs) == 20 + 6 + 20 + 6 + 50 + 3 + 25 + 3 - 4, policy


def test_prefill_first_chunks_a_long_prompt_in_prompt_only_steps_and_decodes_when_none_fits():
    s, bm = make(budget=32, seqs=8, blocks=12, chunked=True, scheduling="prefill-first")
    s.add(req("a", 10, max_tokens=20))
    fake_step(s)
    s.add(req("long", 100, max_tokens=2, base=40))  # 7 blocks: fits beside a's
    kinds = [_kinds(fake_step(s)) for _ in range(4)]
    assert kinds == ["prefill"] * 4  # 32 + 32 + 32 + 4 tokens, a waits
    assert s.requests["long"].num_computed_tokens == 100
    run_all(s)
    bm.check_integrity()

    s, bm = make(budget=256, seqs=8, blocks=12, chunked=False, scheduling="prefill-first")
    s.add(req("a", 10, max_tokens=20))
    s.add(req("b", 90, max_tokens=20, base=40))
    fake_step(s)
    s.add(req("huge", 150, max_tokens=2, base=70))  # 10 blocks whole: not while a and b hold 7 of the 12
    out = fake_step(s)
    assert _kinds(out) == "decode" and {c.request_id for c in out.chunks} == {"a", "b"}  # the decodes do not starve
    run_all(s)
    bm.check_integrity()


def test_prefill_first_puts_remote_kv_admissions_in_decode_steps_not_prompt_steps():
    from pdserve.engine import remote_kv

    s, _ = make(budget=64, seqs=8, blocks=64, scheduling="prefill-first")
    remote = req("r", 40, max_tokens=4)
    assert remote_kv.reserve_remote_blocks(s, remote, 0.0) == 0
    assert remote_kv.admit_remote(s, remote, 7, 0.0, 4096) is None  # queued at the head, decode-ready
    s.add(req("p", 30, max_tokens=2, base=50))
    first = fake_step(s)
    assert [c.request_id for c in first.chunks] == ["p"]  # the prompt steps over the decode-ready request
    second = fake_step(s)
    assert _kinds(second) == "decode" and {c.request_id for c in second.chunks} == {"r", "p"}


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling must be one of mixed, prefill-first"):
        make(scheduling="fcfs")


def _decoding(blocks: int, prefix: bool, max_tokens: int = 40) -> tuple[Scheduler, BlockManager, SchedulerOutput]:
    """Three requests prefilled and decoding, one sharing another's prefix; the first decode step scheduled."""
    s, bm = make(budget=256, blocks=blocks, prefix=prefix)
    s.add(req("a", 30, max_tokens=max_tokens))
    s.add(req("b", 45, max_tokens=max_tokens + 5))
    s.add(req("c", 30, max_tokens=max_tokens))  # a's prompt: a prefix hit with caching on
    while True:
        out = s.schedule()
        if all(len(c.token_ids) == 1 for c in out.chunks) and len(out.chunks) == 3:
            return s, bm, out
        s.update_after_step(out)
        for c in out.chunks:
            if c.samples:
                s.requests[c.request_id].all_token_ids.append(7)


def _state(s: Scheduler, bm: BlockManager) -> tuple:
    requests = {
        rid: (list(r.all_token_ids), r.num_computed_tokens, list(r.block_ids), r.num_registered_blocks)
        for rid, r in s.requests.items()
    }
    return requests, list(bm.free_blocks), list(bm.cached_free), dict(bm.hash_to_block), list(bm.ref_counts)


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("blocks", [64, 12])
def test_a_decode_run_leaves_what_its_steps_one_by_one_leave(prefix, blocks):
    # the simulator's fast path: decode_run_length steps applied at once by advance_decode_run give the same
    # tokens, computed counts, blocks and next step as schedule() and update_after_step() step by step
    s1, bm1, first = _decoding(blocks, prefix)
    n = s1.decode_run_length(first)
    assert n >= 2
    if blocks == 12:
        assert n < 40  # the free pool ends the run before any request's max_tokens
    requests = [s1.requests[c.request_id] for c in first.chunks]
    starts = [c.start for c in first.chunks]
    j = n  # apply steps 1 .. n-1: step n is the last the run holds blocks for
    out1 = s1.advance_decode_run(requests, starts, 1, j, 7)

    s2, bm2, out2 = _decoding(blocks, prefix)
    for _ in range(j - 1):
        s2.update_after_step(out2)
        for c in out2.chunks:
            s2.requests[c.request_id].all_token_ids.append(7)
        out2 = s2.schedule()
    assert out1 == out2
    assert _state(s1, bm1) == _state(s2, bm2)
    # one step past the run would need a block the pool lacks (or a request ends at its max_tokens)
    s2.update_after_step(out2)
    for c in out2.chunks:
        s2.requests[c.request_id].all_token_ids.append(7)
    ended = any(r.num_output_tokens >= r.params.max_tokens for r in s2.requests.values())
    assert ended or s2.schedule().preempted


def test_no_decode_run_while_a_prompt_waits_or_a_prefill_runs():
    s, _, first = _decoding(64, True)
    s.add(req("d", 20))
    assert s.decode_run_length(first) == 0
    s2, _ = make(budget=256)
    s2.add(req("x", 30))
    assert s2.decode_run_length(s2.schedule()) == 0  # a prompt's step


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
