"""How long the explorer's playground takes to answer: ``run_playground`` (what one page change costs
the server: the demo as set and with chunking flipped) for a few settings, median of ``--repeats``.

    python benchmarks/explorer_timing.py [--repeats 3]

The issue's target: under about a second at the demo's sizes (the lesson's 8k prompt, chunk 1024,
24 decodes, and its 32k toggle).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.explorer.playground import PlaygroundSettings, run_playground

SETTINGS = {
    "lesson default (8k, chunk 1024, 24 decodes)": {},
    "32k toggle (chunking off, and on for comparison)": {"prompt_len": 32768, "chunking": False},
    "chunk 256": {"chunk_size": 256},
    "disaggregated 1P:2D": {"mode": "disaggregated", "prefill": 1, "decode": 2},
    "127 decodes (the most the page takes)": {"num_decodes": 127},
    "32k in chunks of 32 (near the work limit)": {"prompt_len": 32768, "chunk_size": 32},
    "32k in chunks of 128 on 8 instances (near the limit)": {"prompt_len": 32768, "chunk_size": 128, "instances": 8},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"{'setting':<52} {'median s':>9} {'max s':>7}")
    for name, body in SETTINGS.items():
        settings = PlaygroundSettings.parse(body)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            run_playground(settings)
            times.append(time.perf_counter() - t)
        print(f"{name:<52} {statistics.median(times):9.3f} {max(times):7.3f}")


if __name__ == "__main__":
    main()
