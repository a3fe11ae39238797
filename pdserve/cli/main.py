"""pdserve: serve an LLM with chunked prefill and disaggregated prefill/decode on Ray; benchmark and simulate it.

Commands: generate (offline, or from a running deployment), serve, status, demo, bench, sim.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.deployment_config import AUTH_TOKEN_ENV, DEFAULT_PORT, DeploymentConfig
from pdserve.engine.config import EngineConfig
from pdserve.messages import Mode
from pdserve.options import (
    HelpFormatter,
    RawDescriptionHelpFormatter,
    add_config_arguments,
    config_from_args,
    config_values,
    option_fields,
    plain_text,
)
from pdserve.router.config import RouterConfig
from pdserve.transport_config import TransportConfig

if TYPE_CHECKING:
    from pdserve.messages import WorkerStats
    from pdserve.router.client import Client


class ServerUnreachable(Exception):
    """A command got no answer from its server: one line names the address and the cause."""


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this much probability")
    g.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: random)")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens, past end-of-sequence")


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.cli.output import format_metadata
    from pdserve.engine import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    if args.offline:
        return _generate_offline(args, params)
    with _rpc_errors(args.target), _client(args) as client:
        final = None
        for chunk in client.generate(args.prompt, params, mode=args.mode, apply_chat_template=not args.raw):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        sys.stdout.write("\n")
    if final is not None:
        print(format_metadata(final.metadata, final.finish_reason), file=sys.stderr)
    return 0


def _generate_offline(args: argparse.Namespace, params: Any) -> int:
    from pdserve.cli.output import format_fields
    from pdserve.engine import LLMEngine

    engine = LLMEngine(config_from_args(EngineConfig, args))
    if engine.tokenizer is None:
        print("error: this model has no tokenizer.json; offline text generation needs one", file=sys.stderr)
        return 2
    prompt = args.prompt
    if not args.raw and not engine.tokenizer.chat_template.is_plain:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    rid = engine.add_request(prompt, params)
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                reason = out.finish_reason
    sys.stdout.write("\n")
    fields = [
        ("finish reason", reason.value if reason else "none"),
        ("steps", str(len(engine.step_history))),
        ("model", args.model),
        ("device", str(engine.device)),
    ]
    print(format_fields(fields), file=sys.stderr)
    return 0


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", help="the router's HOST:PORT")
    g.add_argument(
        "--auth-token",
        default=os.environ.get(AUTH_TOKEN_ENV),
        help=f"bearer token to send (default: ${AUTH_TOKEN_ENV})",
    )
    g.add_argument("--tls-ca", default=None, help="PEM file of the CA to trust: connect with TLS")


def _client(args: argparse.Namespace) -> Client:
    from pdserve.router.client import Client

    try:
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    except OSError as e:
        raise ValueError(f"--tls-ca: cannot read {args.tls_ca}: {e.strerror}") from None
    return Client(args.target, auth_token=args.auth_token, root_certificates=ca)


@contextmanager
def _rpc_errors(target: str) -> Iterator[None]:
    """Turn a failed call into ``ServerUnreachable`` with one line: the address, the status, the cause."""
    import grpc

    try:
        yield
    except grpc.RpcError as e:
        code, details = e.code(), (e.details() or "").strip()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise ServerUnreachable(f"cannot reach {target}: {code.name}: {details}") from None
        raise ServerUnreachable(f"{target} answered {code.name}: {details}") from None


def add_deployment_arguments(p: argparse.ArgumentParser) -> None:
    """The deployment's options (``DeploymentConfig``, its transport, and the router's): ``pdserve serve``."""
    transport = option_fields(TransportConfig)
    add_config_arguments(p, DeploymentConfig, only=transport, title="KV transport")
    add_config_arguments(p, DeploymentConfig, exclude=transport, title="deployment")
    add_config_arguments(p, RouterConfig, title="router")
    p.set_defaults(port=DEFAULT_PORT)


def deployment_config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    """The ``DeploymentConfig`` of ``add_deployment_arguments``' and the engine's options in ``args``."""
    values = config_values(DeploymentConfig, args)
    return DeploymentConfig(
        **values,
        engine=config_from_args(EngineConfig, args),
        router=config_from_args(RouterConfig, args),
        detached_workers=values["address"] is not None,  # on a cluster, a restarted `serve` finds its workers
    )


STOP_STACKS_AFTER_S = 30.0  # ``pdserve serve`` prints every thread's stack if stopping takes longer


def cmd_serve(args: argparse.Namespace) -> int:
    import faulthandler
    import signal
    import threading

    from pdserve.deployment import Deployment

    config = deployment_config_from_args(args)
    print(
        f"starting pdserve: {config.num_prefill_workers} prefill + {config.num_decode_workers} decode workers "
        f"of {config.engine.model}, mode={config.mode}, transport={config.transport}",
        file=sys.stderr,
        flush=True,
    )
    deployment = Deployment(config, progress=lambda line: print(line, file=sys.stderr, flush=True)).start()
    stop = threading.Event()
    # SIGINT too, not left to Python's KeyboardInterrupt: a shell's background job inherits it ignored, and
    # Python then installs no handler for it
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    workers = ", ".join(w.worker_id for w in deployment.workers)
    print(
        f"pdserve listening on {deployment.address} (mode={config.mode}, transport={config.transport}, "
        f"routers: {len(deployment.routers)}, workers: {workers}); Ctrl-C stops",
        flush=True,
    )
    if deployment.http_port is not None:
        print(f"OpenAI-compatible API on {deployment.http_url}/v1 (model {args.model!r})", flush=True)
    if deployment.explorer_port is not None:
        print(f"explorer (playground and live view) on {deployment.explorer_url}", flush=True)
    if deployment.metrics_ports:
        urls = ", ".join(f"http://{args.host}:{p}/metrics" for p in deployment.metrics_ports)
        print(f"Prometheus metrics on {urls}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print("stopping ...", flush=True)
        # a stop is bounded (Deployment.stop); should one still hang, say where, for the bug report
        faulthandler.dump_traceback_later(STOP_STACKS_AFTER_S)
        deployment.stop()
        faulthandler.cancel_dump_traceback_later()
    return 0


STATUS_COLUMNS = ("worker", "role", "node", "device", "KV used", "cached", "free", "running", "waiting", "steps")
_STATUS_COUNTS = ("blocks_used", "blocks_cached", "blocks_free", "num_running", "num_waiting", "num_steps")


def format_status(workers: list[WorkerStats]) -> str:
    """One aligned row per worker of a ``Client.stats()`` answer, under a header of ``STATUS_COLUMNS``."""
    rows: list[tuple[str, ...]] = [STATUS_COLUMNS]
    for w in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        names = (w.worker_id, w.role, w.node or "-", w.device or "-")
        rows.append((*names, *(str(getattr(w, k)) for k in _STATUS_COUNTS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(STATUS_COLUMNS))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def cmd_status(args: argparse.Namespace) -> int:
    with _rpc_errors(args.target), _client(args) as client:
        workers = client.stats()
    print(format_status(workers))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pdserve.cli.demo import run_demo

    return run_demo(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _subcommand(sub: Any, name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> Any:
    p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description=plain_text(__doc__ or ""), formatter_class=RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = _subcommand(
        sub, "generate", "stream a completion (in-process with --offline, else from a router)", cmd_generate
    )
    g.add_argument("prompt", help="the text to answer (the user's turn of a chat, unless --raw)")
    g.add_argument("--offline", action="store_true", help="run the engine in this process")
    g.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is (default: as the user's turn through the model's chat template, when it has one)",
    )
    g.add_argument("--mode", default=None, choices=list(Mode), help="this request's mode (default: the deployment's)")
    _add_client_args(g)
    _add_sampling_args(g)
    add_config_arguments(
        g, EngineConfig, exclude=("seed",), title="engine (with --offline)"
    )  # --seed: the sampling seed

    s = _subcommand(sub, "serve", "start (or join) a Ray cluster, place the workers, serve gRPC", cmd_serve)
    add_config_arguments(s, EngineConfig, title="engine")
    add_deployment_arguments(s)

    st = _subcommand(sub, "status", "per-worker table of a running router: role, node, device, KV, load", cmd_status)
    _add_client_args(st)

    d = _subcommand(
        sub, "demo", "the main job: a local deployment, requests in every mode, a short A/B bench", cmd_demo
    )
    d.add_argument("--model", default="smollm2", help="the model that answers the questions")
    d.add_argument("--bench-model", default="tiny", help="the model the A/B benchmark serves")
    add_config_arguments(d, DeploymentConfig, only=("transport",), title="KV transport")
    d.add_argument("--out", default="results/demo", help="where the benchmark writes its report")
    d.add_argument("--skip-bench", action="store_true", help="only the questions, no benchmark")
    for name, (_, help_text) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


PASSTHROUGH = {  # sub-commands with parsers of their own
    "bench": ("pdserve.bench.runner", "A/B benchmark of the real system (pdserve bench --help)"),
    "sim": ("pdserve.cli.sim", "step-time simulator (pdserve sim --help)"),
    "tokenizer": (
        "pdserve.cli.tokenizer",
        "export the model's tokenizer for Hugging Face tools (pdserve tokenizer --help)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        import importlib

        return importlib.import_module(PASSTHROUGH[argv[0]][0]).main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ServerUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
