"""The gRPC edge: protobuf messages to and from pdserve's typed messages. Neither Ray nor torch in here.

The server and the client both convert here, so a field added to a message is added in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import AdmissionEvent, Logprob, PromptLogprob, RequestMetrics, StepStats, WorkerStats
from pdserve.proto import pdserve_pb2 as pb

MODE_NAMES = {pb.MODE_UNSPECIFIED: None, pb.COLOCATED: "colocated", pb.DISAGGREGATED: "disaggregated", pb.AUTO: "auto"}
MODE_ENUMS = {name: enum for enum, name in MODE_NAMES.items() if name}

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """The engine's parameters (``stop`` strings are the router's: ``p.stop``). Raises ValueError naming the field."""
    return SamplingParams(
        max_tokens=p.max_tokens or 16,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def params_to_proto(params: SamplingParams, stop: Sequence[str] = ()) -> pb.SamplingParams:
    sampling = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        stop=list(stop),
    )
    if params.seed is not None:
        sampling.seed = params.seed
    if params.logprobs is not None:
        sampling.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        sampling.prompt_logprobs = params.prompt_logprobs
    return sampling


def logprobs_to_proto(logprobs: Sequence[Logprob | PromptLogprob]) -> list[pb.TokenLogprob]:
    """Generated tokens' ``(logprob, top)`` or prompt tokens' ``PromptLogprob`` as messages."""
    out = []
    for entry in logprobs:
        if isinstance(entry, PromptLogprob):
            value, rank, top = entry
        else:
            (value, top), rank = entry, 0
        out.append(
            pb.TokenLogprob(logprob=value, rank=rank, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])
        )
    return out


def logprobs_from_proto(entries: Iterable[pb.TokenLogprob]) -> list[PromptLogprob]:
    """``logprobs_to_proto``'s messages back, each as a ``PromptLogprob`` (rank 0 for generated tokens)."""
    return [PromptLogprob(e.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top]) for e in entries]


def metrics_to_proto(metrics: RequestMetrics) -> pb.RequestMetadata:
    return pb.RequestMetadata(**{**metrics._asdict(), "mode": MODE_ENUMS.get(metrics.mode, pb.MODE_UNSPECIFIED)})


def metrics_from_proto(p: pb.RequestMetadata) -> RequestMetrics:
    fields = {name: getattr(p, name) for name in RequestMetrics._fields}
    return RequestMetrics(**{**fields, "mode": MODE_NAMES.get(p.mode) or ""})


def worker_stats_to_proto(stats: WorkerStats) -> pb.WorkerStats:
    steps = [pb.StepRecord(**step._asdict()) for step in stats.steps]
    admissions = [pb.AdmissionEvent(**event._asdict()) for event in stats.admissions]
    return pb.WorkerStats(**{**stats._asdict(), "steps": steps, "admissions": admissions})


def worker_stats_from_proto(p: pb.WorkerStats) -> WorkerStats:
    fields = {name: getattr(p, name) for name in WorkerStats._fields if name not in ("steps", "admissions")}
    steps = tuple(StepStats(**{name: getattr(s, name) for name in StepStats._fields}) for s in p.steps)
    admissions = tuple(AdmissionEvent(e.request_id, e.event, e.time) for e in p.admissions)
    return WorkerStats(**fields, steps=steps, admissions=admissions)
