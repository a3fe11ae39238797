"""``pdserve``: generate (offline or from a router), serve, status, bench, sim."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.messages import WorkerStats

import argparse
import os
import sys
from pathlib import Path

from pdserve.engine.options import add_engine_arguments, engine_config_from_args


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
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

    prompt = args.prompt
    if args.chat:  # the router takes text: render the conversation here, with --model's template
        from pdserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model)
        if tokenizer is None:
            print(f"error: --chat needs a tokenizer; {args.model} has none", file=sys.stderr)
            return 2
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    with _client(args) as client:
        final = None
        for chunk in client.generate(prompt, params, mode=args.mode):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        sys.stdout.write("\n")
        if final is not None and final.metadata is not None:
            print(f"[{final.metadata._asdict()}]", file=sys.stderr)
    return 0


def _generate_offline(args: argparse.Namespace, params) -> int:
    from pdserve.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("error: this model has no tokenizer.json; offline text generation needs one", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat or (args.chat is None and not engine.tokenizer.chat_template.is_plain):
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
    request_stats = engine.step_history
    print(
        f"[finish_reason={reason.value if reason else None} steps={len(request_stats)} "
        f"model={args.model} device={engine.device}]",
        file=sys.stderr,
    )
    return 0


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="router address")
    p.add_argument(
        "--auth-token", default=os.environ.get("PDSERVE_AUTH_TOKEN"), help="bearer token ($PDSERVE_AUTH_TOKEN)"
    )
    p.add_argument("--tls-ca", default=None, help="PEM file of the CA to trust: connect with TLS")


def _client(args: argparse.Namespace):
    from pdserve.router.client import Client

    ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    return Client(args.target, auth_token=args.auth_token, root_certificates=ca)


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        default="colocated",
        choices=["colocated", "disaggregated", "auto"],
        help="default mode (requests may override it)",
    )
    p.add_argument("--prefill-workers", type=int, default=None, help="default: 0 colocated, else 1")
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--transport", default="nixl", choices=["nixl", "grpc"], help="KV transport")
    p.add_argument(
        "--verify-kv",
        action="store_true",
        help="send a CRC-32 of every pushed KV block and check it before decoding (slower)",
    )
    p.add_argument(
        "--kv-host", default="", help="address the gRPC KV transport binds to and advertises; default: this node's"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--routers", type=int, default=1, help="router processes, all on --port (SO_REUSEPORT)")
    p.add_argument(
        "--auth-token",
        default=os.environ.get("PDSERVE_AUTH_TOKEN"),
        help="require this bearer token ($PDSERVE_AUTH_TOKEN)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve the client API over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (and /metrics) on --host at this port; default: off",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics of router i on this port + i (default: off; /metrics is on --http-port too)",
    )
    p.add_argument(
        "--explorer-port",
        type=int,
        default=None,
        help="serve the explorer page (playground and live view) on --explorer-host at this port; default: off",
    )
    p.add_argument("--explorer-host", default="127.0.0.1", help="the explorer's address (loopback by default)")
    p.add_argument("--address", default=None, help="Ray cluster to join ('auto' or host:port); default: local")
    p.add_argument("--auto-min-remote-tokens", type=int, default=512)
    p.add_argument("--auto-max-prefill-queue-tokens", type=int, default=16384)


def deployment_config_from_args(args: argparse.Namespace):
    from pdserve.deployment import DeploymentConfig
    from pdserve.router.policy import RouterConfig

    prefill = args.prefill_workers if args.prefill_workers is not None else (0 if args.mode == "colocated" else 1)
    return DeploymentConfig(
        engine=engine_config_from_args(args),
        mode=args.mode,
        num_prefill_workers=prefill,
        num_decode_workers=args.decode_workers,
        transport=args.transport,
        verify_kv=args.verify_kv,
        kv_host=args.kv_host,
        host=args.host,
        port=args.port,
        num_routers=args.routers,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        explorer_port=args.explorer_port,
        explorer_host=args.explorer_host,
        address=args.address,
        detached_workers=args.address is not None,  # on a cluster, a restarted `serve` finds its workers
        auth_token=args.auth_token,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        router=RouterConfig(
            auto_min_remote_tokens=args.auto_min_remote_tokens,
            auto_max_prefill_queue_tokens=args.auto_max_prefill_queue_tokens,
        ),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from pdserve.deployment import Deployment

    deployment = Deployment(deployment_config_from_args(args)).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    workers = ", ".join(w.worker_id for w in deployment.workers)
    print(
        f"pdserve listening on {deployment.address} (mode={args.mode}, transport={args.transport}, "
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
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        deployment.stop()
    return 0


STATUS_COLUMNS = ("worker", "role", "node", "device", "KV used", "cached", "free", "running", "waiting", "steps")
_STATUS_COUNTS = ("blocks_used", "blocks_cached", "blocks_free", "num_running", "num_waiting", "num_steps")


def format_status(workers: list[WorkerStats]) -> str:
    """One aligned row per worker of a ``Client.stats()`` answer, under a header of ``STATUS_COLUMNS``."""
    rows = [STATUS_COLUMNS]
    for w in sorted(workers, key=lambda w: (w.role, w.worker_id)):
        names = (w.worker_id, w.role, w.node or "-", w.device or "-")
        rows.append((*names, *(str(getattr(w, k)) for k in _STATUS_COUNTS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(STATUS_COLUMNS))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    try:
        with _client(args) as client:
            workers = client.stats()
    except grpc.RpcError as e:
        print(f"error: no answer from {args.target}: {e.code().name} {e.details()}", file=sys.stderr)
        return 1
    print(format_status(workers))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pdserve.cli.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion (in-process with --offline, else from a router)")
    g.add_argument("prompt")
    g.add_argument("--offline", action="store_true", help="run the engine in this process")
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send the prompt as a user turn through the model's chat template "
        "(default: offline, when the model ships a template; from a router, no)",
    )
    _add_client_args(g)
    g.add_argument("--mode", default=None, choices=["colocated", "disaggregated", "auto"])
    _add_sampling_args(g)
    add_engine_arguments(g, exclude=("seed",), title="engine (with --offline)")  # --seed: the sampling seed
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start (or join) a Ray cluster, place the workers, serve gRPC")
    add_engine_arguments(s)
    _add_deployment_args(s)
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="per-worker table of a running router: role, node, device, KV, load")
    _add_client_args(st)
    st.set_defaults(func=cmd_status)

    d = sub.add_parser("demo", help="the main job: a local deployment, requests in every mode, a short A/B bench")
    d.add_argument("--model", default="smollm2", help="the model that answers the questions")
    d.add_argument("--bench-model", default="tiny", help="the model the A/B benchmark serves")
    d.add_argument("--transport", default="nixl", choices=["nixl", "grpc"])
    d.add_argument("--out", default="results/demo", help="where the benchmark writes its report")
    d.add_argument("--skip-bench", action="store_true")
    d.set_defaults(func=cmd_demo)
    for name, (_, help_text) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


PASSTHROUGH = {  # sub-commands with parsers of their own
    "bench": ("pdserve.bench.runner", "A/B benchmark of the real system (pdserve bench --help)"),
    "sim": ("pdserve.sim.cli", "step-time simulator (pdserve sim --help)"),
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
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
