"""Several completions in one request, for either front door: ``n`` choices of each of one or more prompts.

Each choice is a routed request of its own (``Router.generate``). ``Choices.start`` routes them all at once and
waits for each one's first event, so that a refusal reaches the client before anything was sent; ``events``
then merges their streams as they come, and ``collect`` waits for whole answers. Choice ``i`` (``i = prompt *
n + choice``, OpenAI's order) of a request with several is known as ``<request_id>-<i>``, and a seeded
request's choice ``c`` of a prompt draws from ``seed + c`` (as vLLM's), so choices differ yet reproduce;
``Router.abort(request_id)`` stops them all. No protocol in here: the gRPC and HTTP front doors word the
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import NamedTuple

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import Logprob, PromptLogprob, RequestMetrics
from pdserve.router.router import GenerateInput, RequestError, Router, RouterEvent

MAX_CHOICES = 64  # prompts x n in one request
MAX_STOP_STRINGS = 4
_INT64 = 1 << 63


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` of a prompt: ``seed + choice``, kept within a signed 64-bit integer."""
    if seed is None or not choice:
        return seed
    return (seed + choice + _INT64) % (2 * _INT64) - _INT64


class Choice:
    """One choice of one prompt: its routed request's stream, and what the stream has brought so far."""

    def __init__(self, index: int, prompt_index: int, request_id: str, stream: AsyncGenerator[RouterEvent, None]):
        self.index = index  # in the answer: prompt_index * n + choice
        self.prompt_index = prompt_index
        self.request_id = request_id
        self.stream = stream
        self.first: RouterEvent | None = None
        self.num_tokens = 0
        self.metrics: RequestMetrics | None = None  # on its last event

    async def start(self) -> None:
        """Route the request: returns once its first event is here; raises RequestError if it was refused."""
        with contextlib.suppress(StopAsyncIteration):
            self.first = await anext(self.stream)

    async def events(self) -> AsyncGenerator[RouterEvent, None]:
        """Its events from the first, up to and including the last; closes the stream."""
        try:
            if self.first is not None:
                yield self._seen(self.first)
                if self.first.finished:
                    return
            async for event in self.stream:
                yield self._seen(event)
                if event.finished:
                    return
        finally:
            await self.stream.aclose()

    def _seen(self, event: RouterEvent) -> RouterEvent:
        self.num_tokens += len(event.token_ids)
        if event.metrics is not None:
            self.metrics = event.metrics
        return event


class Answer(NamedTuple):
    """A choice's whole answer, as ``Choices.collect`` gathers it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None
    prompt_logprobs: list[PromptLogprob] | None


class Choices:
    """The choices of one request, in index order. Use ``start``; then ``events`` or ``collect``, once."""

    def __init__(self, router: Router, request_id: str | None, choices: list[Choice], n: int) -> None:
        self.router = router
        self.request_id = request_id
        self.choices = choices
        self.n = n

    @classmethod
    async def start(
        cls,
        router: Router,
        request_id: str | None,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        n: int = 1,
        mode: str | None = None,
        stop: tuple[str, ...] = (),
        stream_interval: int = 0,
        fit_max_tokens: bool = False,
        owner: str = "",
    ) -> Choices:
        """Route ``n`` choices of every prompt at once and wait for each one's first event.

        If any is refused, the others are ended and its RequestError is raised. ``request_id`` None: the router
        names each choice; ``owner`` is who sent it (``GenerateInput.owner``).
        """
        if not 1 <= n <= MAX_CHOICES:
            raise RequestError("INVALID_ARGUMENT", f"n: must be in [1, {MAX_CHOICES}], got {n}")
        if len(prompts) * n > MAX_CHOICES:
            raise RequestError(
                "INVALID_ARGUMENT",
                f"prompt: {len(prompts)} prompts x n={n} is over the limit of {MAX_CHOICES} choices",
            )
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError("INVALID_ARGUMENT", f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        many = len(prompts) * n > 1
        choices = []
        for p, prompt in enumerate(prompts):
            for c in range(n):
                index = p * n + c
                rid = f"{request_id}-{index}" if many and request_id is not None else request_id
                choice_params = dataclasses.replace(params, seed=choice_seed(params.seed, c))
                routed = GenerateInput(
                    rid,
                    prompt,
                    choice_params,
                    mode,
                    fit_max_tokens=fit_max_tokens,
                    stream_interval=stream_interval,
                    stop=stop,
                    owner=owner,
                )
                choices.append(Choice(index, p, rid or "", router.generate(routed)))
        self = cls(router, request_id, choices, n)
        if many and request_id is not None:
            router.groups[request_id] = [c.request_id for c in choices]
        try:
            started = await asyncio.gather(*(c.start() for c in choices), return_exceptions=True)
        except BaseException:  # cancelled (the client left): end every choice's request now
            await self.close()
            raise
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await self.close()
            raise next((e for e in failed if isinstance(e, RequestError)), failed[0])
        return self

    async def close(self) -> None:
        """End every choice's request (a no-op for those that ended)."""
        if self.request_id is not None and self.router.groups.get(self.request_id) is not None:
            del self.router.groups[self.request_id]
        await asyncio.gather(*(c.stream.aclose() for c in self.choices), return_exceptions=True)

    async def events(self) -> AsyncGenerator[tuple[Choice, RouterEvent], None]:
        """Every choice's events as they come (one choice: directly, without tasks); ends every choice's request
        when closed early. A choice's failure (RequestError) is raised once the choices before it are read."""
        try:
            if len(self.choices) == 1:
                async with contextlib.aclosing(self.choices[0].events()) as events:
                    async for event in events:
                        yield self.choices[0], event
                return
            async for item in _merged(self.choices):
                yield item
        finally:
            await self.close()

    async def collect(self) -> list[Answer]:
        """Every choice's whole answer, in index order, once all have ended."""
        gathered = {c.index: _Gathered() for c in self.choices}
        async with contextlib.aclosing(self.events()) as events:
            async for choice, event in events:
                gathered[choice.index].add(event)
        return [g.answer() for _, g in sorted(gathered.items())]


@dataclasses.dataclass
class _Gathered:
    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None

    def add(self, event: RouterEvent) -> None:
        self.texts.append(event.text)
        self.token_ids.extend(event.token_ids)
        if event.logprobs is not None:
            self.logprobs = (self.logprobs or []) + event.logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.finish_reason = event.finish_reason or self.finish_reason

    def answer(self) -> Answer:
        return Answer("".join(self.texts), self.token_ids, self.finish_reason, self.logprobs, self.prompt_logprobs)


async def _merged(choices: list[Choice]) -> AsyncGenerator[tuple[Choice, RouterEvent], None]:
    queue: asyncio.Queue[tuple[Choice, RouterEvent] | BaseException | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(choice.events()) as events:
                async for event in events:
                    await queue.put((choice, event))
        except Exception as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
