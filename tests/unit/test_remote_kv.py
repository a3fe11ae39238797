"""engine.remote_kv: the reservation, the admission, the stop rule and the prefill admission rule, torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine import remote_kv
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig


def scheduler(num_blocks: int = 16, block_size: int = 4, budget: int = 32, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64),
        BlockManager(num_blocks, block_size, prefix_caching),
    )


def request(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params), eos_token_id=99)


def test_module_loads_without_torch():
    code = "import sys, pdserve.engine.remote_kv; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_reserve_allocates_the_prompt_and_shares_a_cached_prefix():
    s = scheduler()
    first = request("a", list(range(10)))
    assert remote_kv.reserve_remote_blocks(s, first, now=5.0) == 0
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KV and first.times.first_scheduled == 5.0
    assert len(first.block_ids) == 3 and "a" in s.requests and first not in s.waiting
    remote_kv.admit_remote(s, first, 7, now=6.0, max_model_len=64)
    blocks = list(first.block_ids)
    s.finish(first, FinishReason.ABORT)  # its full blocks stay in the prefix cache
    second = request("b", list(range(10)) + [42, 43])
    assert remote_kv.reserve_remote_blocks(s, second, now=7.0) == 8  # two full blocks need no transfer
    assert second.block_ids[:2] == blocks[:2]


def test_reserve_without_room_changes_nothing():
    s = scheduler(num_blocks=3)
    big = request("big", list(range(13)))  # needs 4 blocks
    before = s.block_manager.usage()
    assert remote_kv.reserve_remote_blocks(s, big, now=0.0) is None
    assert s.block_manager.usage() == before and not s.requests and big.status == RequestStatus.WAITING


def test_admit_marks_the_prompt_computed_and_queues_ahead_of_new_arrivals():
    s = scheduler()
    newcomer = request("new", [1, 2, 3])
    s.add(newcomer)
    remote = request("remote", list(range(20, 29)))
    remote_kv.reserve_remote_blocks(s, remote, now=0.0)
    assert remote_kv.admit_remote(s, remote, 5, now=1.0, max_model_len=64) is None
    assert remote.num_computed_tokens == 9 and remote.output_token_ids == [5] and remote.times.tokens == [1.0]
    assert list(s.waiting) == [remote, newcomer]
    out = s.schedule()
    assert out.chunks[0].request_id == "remote" and len(out.chunks[0].token_ids) == 1  # decodes from here
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        remote_kv.admit_remote(s, newcomer, 5, now=1.0, max_model_len=64)


def test_admit_finishes_a_request_the_first_token_ends():
    s = scheduler()
    one = request("one", list(range(8)), max_tokens=1)
    remote_kv.reserve_remote_blocks(s, one, now=0.0)
    free_before = s.block_manager.usage().used
    assert remote_kv.admit_remote(s, one, 3, now=1.0, max_model_len=64) == FinishReason.LENGTH
    assert one.is_finished and "one" not in s.requests and s.block_manager.usage().used < free_before


@pytest.mark.parametrize(
    ("token", "params", "max_model_len", "expected"),
    [
        (99, {}, 64, FinishReason.STOP),  # EOS
        (99, {"ignore_eos": True}, 64, None),
        (7, {"stop_token_ids": (7,)}, 64, FinishReason.STOP),
        (7, {"max_tokens": 1}, 64, FinishReason.LENGTH),
        (7, {}, 4, FinishReason.LENGTH),  # 3 prompt tokens + 1 output reach max_model_len
        (7, {}, 64, None),
    ],
)
def test_stop_rule(token, params, max_model_len, expected):
    r = Request("r", [1, 2, 3], SamplingParams(**{"max_tokens": 4, **params}), eos_token_id=99)
    assert remote_kv.append_token(r, token, now=2.5, max_model_len=max_model_len) == expected
    assert r.output_token_ids == [token] and r.times.first_token == 2.5


def test_prefill_admission_rule_counts_waiting_prompt_tokens_against_the_budget():
    s = scheduler(num_blocks=64, budget=32)
    assert remote_kv.prefill_admission_open(s)  # empty
    s.add(request("a", list(range(20))))
    assert remote_kv.waiting_prompt_tokens(s) == 20 and remote_kv.prefill_admission_open(s)
    s.add(request("b", list(range(12))))
    assert remote_kv.waiting_prompt_tokens(s) == 32 and not remote_kv.prefill_admission_open(s)  # a full step
    s.update_after_step(s.schedule())  # both start (20 + 12 = the budget): nothing waits any more
    assert remote_kv.waiting_prompt_tokens(s) == 0 and remote_kv.prefill_admission_open(s)
    s.add(request("c", list(range(40))))
    assert not remote_kv.prefill_admission_open(s)
    s.update_after_step(s.schedule())  # c's first chunk takes the budget; the rest of c runs, not waits
    assert remote_kv.prefill_admission_open(s)
