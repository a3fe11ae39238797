"""The disaggregation protocol as the simulator runs it, the engine's ``remote_kv`` functions called as the
workers call them (a mixin of ``sim.simulator.Simulator``, whose event loop drives it).

A prefill instance keeps a FIFO of accepted prompts and admits the head while ``prefill_admission_open`` holds,
reserving its blocks on the decode instance at that moment (``reserve_remote_blocks``, a call applied there
between steps, and its answer; a head that finds no room waits for that decode instance's next step). After
each prefill chunk its KV (tokens x ``kv_bytes_per_token``) is queued on the prefill instance's link (FIFO,
``kv_link_bw`` plus ``kv_link_latency_s``), overlapping the next chunk; the last chunk samples the first token
(to the client, and the router calls the decode side); the prefill side holds its blocks until its last
transfer has landed. The decode instance admits the request (``admit_remote``) once its whole prompt's KV has
arrived *and* the router's decode call has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pdserve.engine import remote_kv
from pdserve.engine.request import Request
from pdserve.router.policy import RoutingPolicy
from pdserve.sim.config import SimConfig
from pdserve.sim.cost_model import CostModel
from pdserve.sim.instance import Client, Instance

DUMMY_TOKEN = 0  # what a simulated step "samples"; never EOS (requests run to max_tokens)


class DisaggregationProtocol:
    """The prefill side's FIFO and admission, the reservation, the KV link and the handoff."""

    if TYPE_CHECKING:  # the simulator's state and event loop that this part uses
        now: float
        config: SimConfig
        cost_model: CostModel
        policy: RoutingPolicy
        link_bw: float
        link_latency_s: float
        kv_bytes_moved: int
        handoff_latencies: Mapping[str, float]
        tie_window_s: float
        _max_model_len: int

        def _at(self, t: float, handler: Callable[..., None], *args: Any) -> None: ...
        def _touch(self, inst: Instance) -> None: ...
        def _woken(self, inst: Instance) -> None: ...
        def _deliver(self, client: Client, finished: bool) -> None: ...
        def _complete(self, client: Client, error: str | None = None) -> None: ...
        def _new_request(self, client: Client, max_tokens: int) -> Request: ...
        def _control_latency(self) -> float: ...
        def _reserve_leg(self, client: Client) -> float: ...
        def _recorded_order(self, client: Client) -> tuple[int, int] | None: ...
        def _take_in(
            self, inst: Instance, client: Client, event: str, action: Callable[[], None], prompt_tokens: int = 0
        ) -> None: ...

    def _admit_prefills(self, inst: Instance) -> None:
        """The prefill worker's FIFO: while ``prefill_admission_open``, reserve blocks for the head on its
        decode instance (a call applied there between steps, and its reply), then add it to the engine.
        One reservation at a time, in order; a head that found no room waits for that decode instance's
        next step (which may free blocks)."""
        if inst.reserving or not inst.fifo or not self._prefill_admission_open(inst):
            return
        client = inst.fifo[0]
        assert client.decode is not None
        inst.reserving = True
        self._at(self.now + self._reserve_leg(client), self._call, client.decode, self._reserve, inst, client)

    @staticmethod
    def _prefill_admission_open(inst: Instance) -> bool:
        """``remote_kv.admission_open`` as the prefill worker applies it: on an idle loop on the waiting
        prompt tokens now; while a step runs, and while the loop does its own work after one (its pushes:
        the gap before its next tick), on those of the loop's last tick (just before the step, so the
        prompts the step computed still count) plus the prompts admitted since."""
        if inst.output is None and not inst.busy:
            waiting_now = remote_kv.waiting_prompt_tokens(inst.scheduler) + inst.deferred_prompt_tokens()
            return remote_kv.admission_open(waiting_now, inst.scheduler.config.max_num_batched_tokens)
        waiting = inst.tick_waiting_tokens + inst.admitted_since_tick
        return remote_kv.admission_open(waiting, inst.scheduler.config.max_num_batched_tokens)

    def _call(self, target: Instance, handler: Callable[..., None], *args: Any) -> None:
        """A call reaching ``target``'s engine loop: applied now unless a step runs, else after that step."""
        self._touch(target)
        if target.output is not None:
            target.commands.append((handler, args))
        else:
            handler(*args)

    def _reserve(self, prefill: Instance, client: Client) -> None:
        """On the decode instance: ``reserve_remote_blocks``; the answer travels back to the prefill instance."""
        assert client.decode is not None
        self._take_in(client.decode, client, "decode_reserved", lambda: self._apply_reserve(prefill, client))

    def _apply_reserve(self, prefill: Instance, client: Client) -> None:
        assert client.decode is not None
        client.meta["decode_reserved_step"] = client.decode.num_steps_started
        reservation = self._new_request(client, client.wreq.max_tokens)
        cached = remote_kv.reserve_remote_blocks(client.decode.scheduler, reservation, self.now)
        if cached is None:
            client.decode.waiting_for_room.add(prefill)
            return
        self._at(self.now + self._reserve_leg(client), self._on_reserved, prefill, client, reservation, cached)

    def _on_reserved(self, inst: Instance, client: Client, reservation: Request, cached: int) -> None:
        inst.reserving = False
        inst.fifo.popleft()
        client.decode_req, client.sent_upto = reservation, cached
        client.meta.update(decode_cached_tokens=cached, kv_bytes=0, reserved_at=self.now)
        client.prefill_req = self._new_request(client, 1)
        inst.admitted_since_tick += client.wreq.num_prompt_tokens
        prefill_req = client.prefill_req

        def queue() -> None:
            client.meta["prefill_queued_step"] = inst.num_steps_started
            inst.scheduler.add(prefill_req)
            self._woken(inst)

        self._take_in(inst, client, "prefill_queued", queue, client.wreq.num_prompt_tokens)

    def _after_prefill_chunk(self, inst: Instance, client: Client, computed: int) -> None:
        """Queue the chunk's new KV on the prefill instance's link; the last push marks the prompt done."""
        nbytes = max(0, computed - client.sent_upto) * self.cost_model.kv_bytes_per_token
        is_last = computed == client.wreq.num_prompt_tokens
        if not nbytes and not is_last:
            return
        start = max(self.now, inst.link_free_at)
        inst.link_free_at = start + nbytes / self.link_bw
        self.kv_bytes_moved += nbytes
        client.meta["kv_bytes"] += nbytes
        client.sent_upto = max(client.sent_upto, computed)
        if is_last:
            self._at(inst.link_free_at + self.link_latency_s, self._on_kv_complete, client)

    def _first_token_remote(self, client: Client) -> None:
        """The prefill instance sampled the first token: to the client, and the router calls the decode side."""
        self._deliver(client, finished=False)
        client.meta["prefill_done"] = self.now
        assert client.route is not None
        self.policy.prefill_done(client.route, client.wreq.prompt_token_ids)
        handoff = self.handoff_latencies.get(client.wreq.request_id, self.config.handoff_latency_s)
        called = client.token_times[0] + self._control_latency() if handoff is None else self.now + handoff
        self._at(called, self._on_decode_call, client)

    def _on_kv_complete(self, client: Client) -> None:
        assert client.prefill is not None and client.prefill_req is not None
        client.prefill.scheduler.block_manager.free(client.prefill_req)  # every push is out: release
        client.kv_complete = True
        if client.done:
            client.prefill_req = None
        client.meta["kv_done"] = self.now
        self._admit_remote(client)

    def _on_decode_call(self, client: Client) -> None:
        client.decode_called = True
        self._admit_remote(client)

    def _admit_remote(self, client: Client) -> None:
        if not (client.kv_complete and client.decode_called) or client.done:
            return
        assert client.decode is not None and client.decode_req is not None
        decode, decode_req = client.decode, client.decode_req

        def queue() -> None:
            if client.done:
                return
            self._touch(decode)
            client.meta["decode_queued_step"] = decode.num_steps_started
            reason = remote_kv.admit_remote(decode.scheduler, decode_req, DUMMY_TOKEN, self.now, self._max_model_len)
            self._woken(decode)
            if reason is not None:  # the first token already ended it: only the end of the stream is left
                self._at(self.now + self.config.token_latency_s, self._complete, client)

        self._take_in(decode, client, "decode_queued", queue)

    def _enqueue_prefill(self, inst: Instance, client: Client) -> None:
        """Append ``client`` to the prefill instance's FIFO. Under replay, calls that reached it within the tie
        window of each other keep the order in which the run's workers took them in (their recorded step
        counts: the prefill worker's queue, then the decode worker's reservation), not the replayed timeline's."""
        client.queued_at = self.now
        fifo = inst.fifo
        fifo.append(client)
        rank = self._recorded_order(client)
        if rank is None or self.tie_window_s <= 0:
            return
        i, first_movable = len(fifo) - 1, 1 if inst.reserving else 0  # the head being reserved stays
        while i > first_movable:
            before = fifo[i - 1]
            before_rank = self._recorded_order(before)
            if before_rank is None or before_rank <= rank or self.now - before.queued_at > self.tie_window_s:
                break
            fifo[i - 1], fifo[i] = client, before
            i -= 1
