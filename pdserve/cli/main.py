"""``pdserve``: generate (offline or from a router), serve, bench, sim."""

from __future__ import annotations

import argparse
import sys


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
    from pdserve.router.client import Client

    prompt = args.prompt
    if args.chat:  # the router takes text: render the conversation here, with --model's template
        from pdserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model)
        if tokenizer is None:
            print(f"error: --chat needs a tokenizer; {args.model} has none", file=sys.stderr)
            return 2
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    with Client(args.target) as client:
        final = None
        for chunk in client.generate(prompt, params, mode=args.mode):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        sys.stdout.write("\n")
        if final is not None and final.metadata is not None:
            print(f"[{final.metadata}]", file=sys.stderr)
    return 0


def _generate_offline(args: argparse.Namespace, params) -> int:
    from pdserve.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model))
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


def _add_engine_args(p: argparse.ArgumentParser, model_default: str = "tiny") -> None:
    p.add_argument("--model", default=model_default, help="preset (tiny, bench) or HF checkpoint directory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.5)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-chunk-tokens", type=int, default=None, help="per-request chunk cap")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads per worker")


def engine_config_from_args(args: argparse.Namespace):
    from pdserve.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_chunk_tokens=args.max_chunk_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        torch_threads=args.torch_threads,
    )


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
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
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
        host=args.host,
        port=args.port,
        address=args.address,
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
        f"workers: {workers}); Ctrl-C stops",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        deployment.stop()
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
    g.add_argument("--model", default="tiny", help="preset (tiny, bench, smollm2), GGUF file or HF checkpoint dir")
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send the prompt as a user turn through the model's chat template "
        "(default: offline, when the model ships a template; from a router, no)",
    )
    g.add_argument("--target", default="127.0.0.1:50051", help="router address (without --offline)")
    g.add_argument("--mode", default=None, choices=["colocated", "disaggregated", "auto"])
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start (or join) a Ray cluster, place the workers, serve gRPC")
    _add_engine_args(s)
    _add_deployment_args(s)
    s.set_defaults(func=cmd_serve)

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
    "sim": ("pdserve.bench.sim.cli", "step-time simulator (pdserve sim --help)"),
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
