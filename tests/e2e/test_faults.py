"""Faults on a local Ray cluster: workers that die, engines that crash, KV that stops arriving, clients
that leave, routers that restart. Every case ends in a completed request or a clear status within
seconds, with no KV block left in use anywhere and the deployment serving again."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time

import grpc
import pytest
import ray
from support.checks import assert_no_leaks, wait_until

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.faults import NO_FAULTS, FaultPlan
from pdserve.kv_transfer.nixl_transport import NixlConfig
from pdserve.router.client import Client
from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(
    model="tiny", device="cpu", num_kv_blocks=400, max_num_batched_tokens=32, torch_threads=1, max_model_len=1024
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
PROMPT = [random.Random(3).randrange(256) for _ in range(300)]


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return LLMEngine(ENGINE).generate([PROMPT], GREEDY)[0].token_ids


def deployment(**kwargs) -> Deployment:
    defaults = dict(
        engine=ENGINE,
        mode="disaggregated",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport="grpc",
        verify_kv=True,  # every pushed block is checked on arrival
        kv_host="127.0.0.1",  # tests stay on loopback
        reservation_ttl_s=4.0,
        push_timeout_s=1.0,
        router=RouterConfig(),
    )
    return Deployment(DeploymentConfig(**{**defaults, **kwargs}))


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_a_prefill_worker_dying_mid_prefill_falls_back_to_local_prefill_and_rejoins(ray_cluster, expected, transport):
    with deployment(transport=transport) as d, Client(d.address) as client:
        prefill = d.prefill_workers[0].actor
        ray.get(prefill.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))  # 10 chunks of 32 tokens, 200 ms each
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(chunks=list(client.generate(PROMPT, GREEDY))))
        thread.start()
        with Client(d.address) as probe:
            wait_until(lambda: any(w.role == "prefill" and w.num_steps >= 2 for w in probe.stats()), 10, "prefill")
        killed = time.monotonic()
        ray.kill(prefill, no_restart=False)  # Ray restarts it (worker_max_restarts)
        thread.join(30)
        assert not thread.is_alive()
        completed_s = time.monotonic() - killed
        metrics = result["chunks"][-1].metadata
        assert tokens_of(result["chunks"]) == expected
        assert metrics.mode == "colocated" and metrics.fallback.startswith("prefill worker failed")
        assert completed_s < 10, completed_s
        assert_no_leaks(d, integrity=False)

        def disaggregated_again():  # the restarted worker rejoins the pool
            chunks = list(client.generate(PROMPT, GREEDY))
            assert tokens_of(chunks) == expected
            return chunks[-1].metadata.prefill_worker == "prefill-0"

        wait_until(disaggregated_again, 60, "the restarted prefill worker to serve again", interval_s=0.5)
        assert_no_leaks(d, integrity=False)


def test_a_decode_worker_dying_mid_stream_fails_fast_and_the_others_keep_serving(ray_cluster, expected):
    with deployment(mode="colocated", num_prefill_workers=0, num_decode_workers=2) as d, Client(d.address) as client:
        stream = client.generate(PROMPT, LONG, request_id="doomed")
        next(stream)
        running = wait_until(
            lambda: [w.worker_id for w in client.stats() if w.num_running > 0], 10, "the stream's decode worker"
        )
        [victim] = running
        killed = time.monotonic()
        ray.kill(next(w.actor for w in d.decode_workers if w.worker_id == victim), no_restart=False)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and victim in err.value.details()
        assert time.monotonic() - killed < 5
        for _ in range(4):  # the survivor serves everything meanwhile
            assert tokens_of(client.generate(PROMPT, GREEDY)) == expected
        wait_until(lambda: client.health().status == "serving", 60, f"{victim} to rejoin", interval_s=0.5)
        assert_no_leaks(d, integrity=False)


def test_a_crashed_engine_loop_fails_its_requests_at_once_and_its_worker_is_replaced(ray_cluster, expected):
    with deployment(mode="colocated", num_prefill_workers=0) as d, Client(d.address) as client:
        stream = client.generate(PROMPT, LONG)
        next(stream)
        crashed = time.monotonic()
        ray.get(d.decode_workers[0].actor.set_fault_plan.remote(FaultPlan(crash_step=True)))
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "injected engine fault" in err.value.details()
        assert time.monotonic() - crashed < 5
        wait_until(lambda: not client.health().ok, 10, "Health to report NOT serving", interval_s=0.05)
        wait_until(lambda: client.health().ok, 60, "the replaced worker to serve", interval_s=0.5)
        assert tokens_of(client.generate(PROMPT, GREEDY)) == expected
        assert_no_leaks(d, integrity=False)


def test_kv_that_stops_arriving_ends_the_request_clearly_and_frees_both_sides(ray_cluster, expected):
    with deployment() as d, Client(d.address) as client:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(stall_pushes=True)))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(PROMPT, GREEDY))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # the prefill worker gives up first (its pushes must end before the deadline), else the deadline passes
        assert "KV was not all pushed" in err.value.details() or "KV transfer deadline" in err.value.details()
        assert time.monotonic() - started < 4.0 + 5  # the reservation TTL, plus slack
        assert_no_leaks(d, integrity=False)
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(NO_FAULTS))
        assert tokens_of(client.generate(PROMPT, GREEDY)) == expected


def test_a_client_deadline_aborts_the_request_on_every_worker(ray_cluster):
    with deployment() as d, Client(d.address, timeout_s=1.0) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(PROMPT, SamplingParams(max_tokens=720, temperature=0.0, ignore_eos=True)))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert_no_leaks(d, integrity=False)


def test_a_restarted_router_finds_the_running_workers(ray_cluster, expected):
    first = deployment(detached_workers=True).start()
    pids = sorted(info["pid"] for info in first.worker_info)
    for router in first.routers:  # the router process dies; the workers live on
        ray.kill(router)
    with deployment(detached_workers=True) as second, Client(second.address) as client:
        assert sorted(info["pid"] for info in second.worker_info) == pids
        assert tokens_of(client.generate(PROMPT, GREEDY)) == expected
        assert_no_leaks(second, integrity=False)


LONG_PROMPT = [random.Random(11).randrange(256) for _ in range(900)]


def prefill_blocks_back_at(d: Deployment, timeout_s: float) -> float:
    """``time.monotonic()`` when every prefill worker that answers has all its KV blocks free or cached."""
    with Client(d.address) as c:

        def clean():
            stats = [w for w in c.stats() if w.role == "prefill" and w.state == "serving"]
            return stats and all(w.blocks_free + w.blocks_cached == w.blocks_total for w in stats)

        wait_until(clean, timeout_s, "the prefill worker's KV blocks to be back", interval_s=0.05)
    return time.monotonic()


def disaggregated_in_background(client: Client, prompt: list[int]) -> tuple[threading.Thread, dict]:
    """A disaggregated request run on a thread; the dict gets its status ``code`` (and ``details``) and the
    monotonic time ``at`` which it ended."""
    outcome: dict = {}

    def run() -> None:
        try:
            list(client.generate(prompt, GREEDY, mode="disaggregated"))
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            outcome["code"], outcome["details"] = e.code(), e.details()
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_a_decode_worker_dying_while_a_long_prefill_pushes_fails_fast_and_frees_the_prefill_side(
    ray_cluster, expected, transport
):
    with deployment(transport=transport) as d, Client(d.address) as client:
        prefill = d.prefill_workers[0].actor
        # 29 chunks of 32 tokens, 200 ms each: pushing for ~6 s
        ray.get(prefill.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))
        thread, outcome = disaggregated_in_background(client, LONG_PROMPT)
        with Client(d.address) as probe:
            wait_until(lambda: any(w.role == "prefill" and w.num_steps >= 3 for w in probe.stats()), 20, "pushes")
        killed = time.monotonic()
        ray.kill(d.decode_workers[0].actor, no_restart=False)  # Ray restarts it (worker_max_restarts)
        time.sleep(0.5)
        ray.get(prefill.stats.remote(), timeout=3)  # the prefill worker keeps answering
        thread.join(15)
        assert not thread.is_alive(), "the client got no answer"
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE, outcome
        assert outcome["at"] - killed < 10, outcome["at"] - killed
        assert prefill_blocks_back_at(d, 10) - killed < 10
        ray.get(prefill.set_fault_plan.remote(NO_FAULTS))
        wait_until(lambda: client.health().status == "serving", 60, "the decode worker to rejoin", interval_s=0.5)
        for mode in ("disaggregated", "colocated"):  # the next requests in every mode succeed
            chunks = list(client.generate(PROMPT, GREEDY, mode=mode))
            assert tokens_of(chunks) == expected and chunks[-1].metadata.mode == mode
        assert_no_leaks(d, integrity=False)


HUNG_ENGINE = dataclasses.replace(ENGINE, num_kv_blocks=600, max_num_batched_tokens=128, max_model_len=3200)
HUNG_PROMPT = [random.Random(17).randrange(256) for _ in range(3000)]


@pytest.mark.parametrize("transport", ["grpc", "nixl", "nixl-tcp"])
def test_a_hung_decode_worker_while_a_long_prefill_pushes_fails_fast_and_frees_the_prefill_side(ray_cluster, transport):
    """SIGSTOP, not a kill: the decode worker's process, its sockets and its Ray actor all stay up, it just
    answers nothing; nothing may wait for it past the push timeout."""
    expected = LLMEngine(HUNG_ENGINE).generate([PROMPT], GREEDY)[0].token_ids
    config = dict(transport=transport, engine=HUNG_ENGINE, push_timeout_s=3.0, reservation_ttl_s=30.0)
    if transport == "nixl-tcp":  # UCX over TCP: a write into a stopped process cannot complete (shared memory can)
        config.update(transport="nixl", transport_config=NixlConfig(ucx_tls="tcp"))
    with deployment(**config) as d, Client(d.address) as client:
        prefill = d.prefill_workers[0].actor
        [decode_pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == "decode-0"]
        ray.get(prefill.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))  # 24 chunks of 128 tokens, 200 ms more each
        thread, outcome = disaggregated_in_background(client, HUNG_PROMPT)
        try:
            with Client(d.address) as probe:
                wait_until(lambda: any(w.role == "prefill" and w.num_steps >= 3 for w in probe.stats()), 30, "pushes")
            os.kill(decode_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            thread.join(15)
            answered = not thread.is_alive()
            blocks_back_s = prefill_blocks_back_at(d, 10) - stopped
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        thread.join(30)
        assert answered, f"the client got no answer within 15 s of the decode worker hanging: {outcome}"
        assert outcome["code"] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), outcome
        assert outcome["at"] - stopped < 10, outcome["at"] - stopped
        assert blocks_back_s < 10, blocks_back_s
        ray.get(prefill.set_fault_plan.remote(NO_FAULTS))
        wait_until(lambda: client.health().status == "serving", 60, "the decode worker to serve again", interval_s=0.5)
        for mode in ("disaggregated", "colocated", "auto"):  # the next requests in every mode succeed
            chunks = list(client.generate(PROMPT, GREEDY, mode=mode))
            assert tokens_of(chunks) == expected, mode
            assert mode == "auto" or chunks[-1].metadata.mode == mode
        assert_no_leaks(d)


def test_a_hung_decode_worker_mid_stream_fails_its_stream_and_the_other_keeps_serving(ray_cluster, expected):
    with deployment(mode="colocated", num_prefill_workers=0, num_decode_workers=2) as d, Client(d.address) as client:
        stream = client.generate(PROMPT, LONG, request_id="stalled")
        next(stream)
        [victim] = wait_until(
            lambda: [w.worker_id for w in client.stats() if w.num_running > 0], 10, "the stream's decode worker"
        )
        [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == victim]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            status_s = time.monotonic() - stopped
            for _ in range(3):  # meanwhile the other worker serves everything
                assert tokens_of(client.generate(PROMPT, GREEDY)) == expected
        finally:
            os.kill(pid, signal.SIGCONT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and victim in err.value.details(), err.value
        assert status_s < 10, status_s
        wait_until(lambda: client.health().status == "serving", 30, f"{victim} to serve again", interval_s=0.5)
        assert_no_leaks(d)


# ---- hangs: a worker that stops answering, an engine that stops stepping, a router that goes away --------------


def test_a_decode_worker_hung_before_its_reservation_fails_the_request_at_the_silence_timeout(ray_cluster, expected):
    """The prefill worker's reservation call gets no answer: the client hears at the router's silence timeout
    (5 s), not after the reservation calls' and the abort fences' bounds."""
    with deployment() as d, Client(d.address) as client:
        [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == "decode-0"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            thread, outcome = disaggregated_in_background(client, PROMPT)
            thread.join(20)
            assert not thread.is_alive(), "the client got no answer"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE and "decode-0" in outcome["details"], outcome
        assert outcome["at"] - stopped < 9, outcome["at"] - stopped
        wait_until(lambda: client.health().status == "serving", 30, "decode-0 to serve again", interval_s=0.5)
        assert tokens_of(client.generate(PROMPT, GREEDY, mode="disaggregated")) == expected
        assert_no_leaks(d)


def test_a_hung_prefill_worker_fails_its_prefill_naming_it_and_serves_again_once_resumed(ray_cluster, expected):
    # a reservation deadline past the silence timeout: the router's probe, not the deadline, notices the hang
    with deployment(reservation_ttl_s=30.0) as d, Client(d.address) as client:
        prefill = d.prefill_workers[0].actor
        [pid] = [info["pid"] for info in d.worker_info if info["worker_id"] == "prefill-0"]
        ray.get(prefill.set_fault_plan.remote(FaultPlan(step_delay_s=0.2)))  # 29 chunks: about 6 s
        thread, outcome = disaggregated_in_background(client, LONG_PROMPT)
        with Client(d.address) as probe:
            wait_until(lambda: any(w.role == "prefill" and w.num_steps >= 3 for w in probe.stats()), 20, "prefill")
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            thread.join(15)
            assert not thread.is_alive(), "the client got no answer"
            assert "prefill-0" in client.health().status  # named down
        finally:
            os.kill(pid, signal.SIGCONT)
        assert (
            outcome["code"] == grpc.StatusCode.UNAVAILABLE and "prefill worker prefill-0 is hung" in outcome["details"]
        ), outcome
        assert outcome["at"] - stopped < 9, outcome["at"] - stopped
        ray.get(prefill.set_fault_plan.remote(NO_FAULTS))

        def disaggregated_again():
            chunks = list(client.generate(PROMPT, GREEDY, mode="disaggregated"))
            assert tokens_of(chunks) == expected
            return chunks[-1].metadata.prefill_worker == "prefill-0"

        wait_until(disaggregated_again, 30, "the resumed prefill worker to serve again", interval_s=0.5)
        assert_no_leaks(d)


def test_a_stalled_decode_engine_fails_its_stream_naming_it_and_the_other_serves(ray_cluster, expected):
    """The engine thread blocks (a device hang) while the process, its event loop and its heartbeats run on."""
    config = dict(mode="colocated", num_prefill_workers=0, num_decode_workers=2, engine_stall_timeout_s=2.0)
    with deployment(**config) as d, Client(d.address) as client:
        stream = client.generate(PROMPT, LONG, request_id="stalls")
        next(stream)
        [victim] = wait_until(
            lambda: [w.worker_id for w in client.stats() if w.num_running > 0], 10, "the stream's decode worker"
        )
        actor = next(w.actor for w in d.decode_workers if w.worker_id == victim)
        ray.get(actor.set_fault_plan.remote(FaultPlan(engine_hang_s=10.0)))
        struck = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        status_s = time.monotonic() - struck
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"decode worker {victim} is hung" in err.value.details(), err.value.details()
        assert status_s < 6, status_s
        assert victim in client.health().status
        for _ in range(2):  # the other worker serves meanwhile
            assert tokens_of(client.generate(PROMPT, GREEDY)) == expected
        wait_until(lambda: client.health().status == "serving", 30, f"{victim} to step again", interval_s=0.5)
        assert_no_leaks(d)


def test_a_dead_routers_queued_prefills_are_withdrawn_long_before_their_deadline(ray_cluster):
    with deployment(reservation_ttl_s=30.0) as d:
        ray.get(d.prefill_workers[0].actor.set_fault_plan.remote(FaultPlan(step_delay_s=0.3)))
        clients = [Client(d.address, timeout_s=60) for _ in range(5)]
        threads = []
        for i, c in enumerate(clients):
            prompt = [random.Random(100 + i).randrange(256) for _ in range(300)]
            threads.append(threading.Thread(target=lambda c=c, p=prompt: list(_quietly(c.generate(p, GREEDY)))))
            threads[-1].start()
        wait_until(lambda: any(w.num_remote_pending for w in d.stats() if w.role == "decode"), 20, "reservations")
        for router in d.routers:
            ray.kill(router)
        killed = time.monotonic()
        d.routers = []

        def all_back() -> bool:
            return all(
                w.blocks_free + w.blocks_cached == w.blocks_total and w.num_running + w.num_waiting == 0
                for w in d.stats()
            )

        wait_until(all_back, 20, "every block back on both workers")
        assert time.monotonic() - killed < 15  # the reservations' deadline is 30 s
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()


def _quietly(chunks):
    try:
        yield from chunks
    except grpc.RpcError:
        return
