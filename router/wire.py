"""The gRPC edge: protobuf messages to and from pdserve's typed messages. Neither Ray nor torch in here.

The server and the client both convert here, so a field added to a message is added in one place.
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb

MODE_NAMES = {pb.MODE_UNSPECIFIED: None, pb.COLOCATED: "colocated", pb.DISAGGREGATED: "disaggregated", pb.AUTO: "auto"}
MODE_ENUMS = {name: enum for enum, name in MODE_NAMES.items() if name}

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field."""
    return SamplingParams(
        max_tokens=p.max_tokens or 16,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    sampling = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        sampling.seed = params.seed
    return sampling
