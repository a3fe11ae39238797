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
    from engine import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.offline:
        return _generate_offline(args, params)
    from router.client import Client

    with Client(args.target) as client:
        final = None
        for chunk in client.generate(args.prompt, params, mode=args.mode):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        sys.stdout.write("\n")
        if final is not None and final.metadata is not None:
            print(f"[{final.metadata}]", file=sys.stderr)
    return 0


def _generate_offline(args: argparse.Namespace, params) -> int:
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model))
    if engine.tokenizer is None:
        print("error: this model has no tokenizer.json; offline text generation needs one", file=sys.stderr)
        return 2
    rid = engine.add_request(args.prompt, params)
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                reason = out.finish_reason
    sys.stdout.write("\n")
    request_stats = engine.step_history
    print(f"[finish_reason={reason.value if reason else None} steps={len(request_stats)} "
          f"model={args.model} device={engine.device}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion (in-process with --offline, else from a router)")
    g.add_argument("prompt")
    g.add_argument("--offline", action="store_true", help="run the engine in this process")
    g.add_argument("--model", default="tiny", help="preset (tiny, bench) or HF checkpoint directory")
    g.add_argument("--target", default="127.0.0.1:50051", help="router address (without --offline)")
    g.add_argument("--mode", default=None, choices=["colocated", "disaggregated", "auto"])
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
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
