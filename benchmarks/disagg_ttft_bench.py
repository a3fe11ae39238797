"""TTFT of one long prompt on an idle deployment: disaggregated (prefill worker + per-chunk KV streaming)
vs colocated (the decode worker prefills), same chunk size, same deployment, alternating runs.

    python benchmarks/disagg_ttft_bench.py [--prompt-len 4096] [--chunk 512] [--runs 3] [--transport nixl]
        [--device cuda --gpus-per-worker 0.5]

Target: disaggregated TTFT within 15% of colocated — per-chunk streaming hides the transfer behind the
next chunk's compute, so only the last chunk's KV is exposed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.router.client import Client
from pdserve.transport_config import TRANSPORTS


def run_once(client: Client, prompt: list[int], mode: str) -> dict:
    sent = time.time()
    first = None
    meta = None
    for chunk in client.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), mode=mode):
        if first is None and chunk.token_ids:
            first = time.time()
        meta = chunk.metadata or meta
    assert first is not None and meta is not None and meta.mode == mode, meta
    return {**meta._asdict(), "ttft_s": first - sent}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--transport", default="nixl", choices=TRANSPORTS)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--gpus-per-worker", type=float, default=1.0, help="on CUDA: GPUs per worker (0.5: both workers on one GPU)"
    )
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"error: --device {args.device}: no CUDA device", file=sys.stderr)
            return 1

    engine = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_batched_tokens=args.chunk,
        torch_threads=args.torch_threads,
        kv_cache_memory_gb=1.0,
    )
    config = DeploymentConfig(
        engine=engine,
        mode="colocated",
        num_prefill_workers=1,
        num_decode_workers=1,
        transport=args.transport,
        gpus_per_worker=args.gpus_per_worker,
        port=0,
    )
    rng = random.Random(0)
    results: dict[str, list[dict]] = {"colocated": [], "disaggregated": []}
    with Deployment(config) as deployment, Client(deployment.address) as client:
        run_once(client, [rng.randrange(256) for _ in range(256)], "disaggregated")  # warm-up: connections
        run_once(client, [rng.randrange(256) for _ in range(256)], "colocated")
        for i in range(args.runs):
            for mode in ("colocated", "disaggregated") if i % 2 == 0 else ("disaggregated", "colocated"):
                prompt = [rng.randrange(256) for _ in range(args.prompt_len)]  # fresh: no prefix cache hit
                results[mode].append(run_once(client, prompt, mode))
                r = results[mode][-1]
                print(
                    f"run {i} {mode:>13}: TTFT {r['ttft_s'] * 1000:8.1f} ms  "
                    f"(prefill {r['prefill_s'] * 1000:7.1f} ms, "
                    f"exposed KV transfer {r['kv_transfer_s'] * 1000:6.1f} ms, "
                    f"{r['kv_transfer_bytes'] / 2**20:6.1f} MiB moved)",
                    flush=True,
                )

    col = statistics.median(r["ttft_s"] for r in results["colocated"])
    dis = statistics.median(r["ttft_s"] for r in results["disaggregated"])
    ratio = dis / col
    print(
        f"\nmodel={args.model} prompt={args.prompt_len} tokens chunk={args.chunk} transport={args.transport} "
        f"runs={args.runs}"
    )
    print(f"median TTFT colocated     {col * 1000:8.1f} ms")
    print(
        f"median TTFT disaggregated {dis * 1000:8.1f} ms   ratio {ratio:.3f}  "
        f"(target <= 1.15: {'PASS' if ratio <= 1.15 else 'MISS'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
