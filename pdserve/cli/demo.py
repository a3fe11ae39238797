"""``pdserve demo``: the main job. A local deployment on the embedded model, a request in every mode
(tokens and per-request metadata printed), then a short A/B benchmark of the architectures; stops all."""

from __future__ import annotations

import argparse
import time

from pdserve.engine import EngineConfig, SamplingParams

DEMO_PROMPTS = [
    ("colocated", "Chunked prefill splits a long prompt into pieces. "),
    ("disaggregated", "Disaggregation moves the prefill to another worker and streams its KV. "),
    ("auto", "short prompt"),
    ("auto", "A long prompt goes remote in auto mode. " * 8),
]


def _fmt_meta(meta: dict) -> str:
    keys = (
        "mode",
        "prefill_worker",
        "decode_worker",
        "ttft_s",
        "queue_s",
        "prefill_s",
        "kv_transfer_s",
        "kv_transfer_bytes",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_cached_tokens",
        "e2e_s",
    )
    parts = []
    for k in keys:
        v = meta.get(k)
        if isinstance(v, float):
            v = f"{v * 1000:.1f}ms" if k.endswith("_s") else f"{v:.3f}"
        if v not in (None, ""):
            parts.append(f"{k}={v}")
    return " ".join(parts)


def run_demo(args: argparse.Namespace) -> int:
    from pdserve.deployment import Deployment, DeploymentConfig
    from pdserve.router.client import Client
    from pdserve.router.policy import RouterConfig

    engine = EngineConfig(
        model=args.model,
        device="cpu" if args.model in ("tiny", "bench") else "auto",
        max_num_batched_tokens=256,
        torch_threads=1,
    )
    config = DeploymentConfig(
        engine=engine,
        mode="auto",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport=args.transport,
        port=0,
        router=RouterConfig(auto_min_remote_tokens=128),
    )
    t0 = time.time()
    print(
        f"starting a local deployment: 1 prefill + 1 decode worker, model={args.model}, "
        f"KV transport={args.transport}, default mode=auto ...",
        flush=True,
    )
    with Deployment(config) as deployment:
        print(f"router listening on {deployment.address} (started in {time.time() - t0:.1f} s)\n", flush=True)
        with Client(deployment.address) as client:
            for mode, prompt in DEMO_PROMPTS:
                params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
                tokens: list[int] = []
                text, meta = [], {}
                for chunk in client.generate(prompt, params, mode=mode):
                    tokens += chunk.token_ids
                    text.append(chunk.text)
                    meta = chunk.metadata._asdict() if chunk.metadata else meta
                print(f"[{mode:>13}] prompt={len(prompt.encode())} bytes -> {len(tokens)} tokens: {tokens[:12]} ...")
                print(f"                text={''.join(text)!r}")
                print(f"                {_fmt_meta(meta)}\n", flush=True)
            for w in client.stats():
                print(
                    f"worker {w.worker_id:>10} ({w.role}): blocks total={w.blocks_total} "
                    f"free={w.blocks_free} cached={w.blocks_cached} used={w.blocks_used} "
                    f"steps={w.num_steps} kv_bytes_moved={w.kv_bytes_moved}"
                )
    if not args.skip_bench:
        from pdserve.bench.runner import main as bench_main

        print("\nA/B benchmark (short): colocated 2 workers vs 1 prefill + 1 decode vs auto ...", flush=True)
        return bench_main(
            [
                "--model",
                args.model,
                "--architectures",
                "colocated,disaggregated,auto",
                "--workers",
                "2",
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
    return 0
