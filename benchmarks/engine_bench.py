# Over 500 lines: one script, three sections that share its helpers and one summary (HF side: hf_reference.py).
"""Single-engine benchmark: pdserve's LLMEngine against Hugging Face ``generate``, in one process.

Three measurements, side by side in one run (the machines are shared: never compare across runs):

1. Throughput: output tokens/s of ``LLMEngine.generate`` vs ``transformers`` ``generate`` on the SAME
   weights (the ``bench`` preset loaded into a ``LlamaForCausalLM``), the same seeded mix of requests
   (64; prompts 32-512, outputs 32-256 tokens, ids in [0, 256)), greedy, EOS ignored. ``generate`` is
   batched as a user would: sorted by prompt length, batches of 16, left padding with an attention mask,
   ``max_new_tokens`` = the batch's largest request; only each request's own requested tokens count.
   Logits of one prompt are compared first. HF runs half its batches before pdserve and half after.
   pdserve runs at the engine's defaults (token budget 512, ``EngineConfig``). Target: pdserve >= 1.5x.
2. Interference: 16 streaming decodes, then a 4096-token prompt arrives. Worst inter-token latency of the
   decodes while it prefills, and its TTFT, with chunked prefill off and with chunks of 256 and 512
   (the step's token budget); 3 interleaved trials per setting, medians. Target: worst ITL >= 5x lower.
3. Scheduler overhead: 64 running requests in decode; ``schedule_s / duration_s`` per step (median),
   plus where the rest of the step goes. Target: <= 5%.

    python benchmarks/engine_bench.py [--quick] [--json PATH] [--profile] [--only SECTION] [--threads N]

``--quick`` (under a minute): 32 requests with shorter prompts/outputs, a 2048-token prompt with chunks
of 128/256, one trial. torch uses 2 threads on both sides; OMP_WAIT_POLICY=PASSIVE unless --omp-spin.
It is a benchmark, not a test: it prints figures and a summary with targets, and exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

# On a shared 2-core machine, OpenMP threads that spin at barriers turn other people's load into
# 0.5-1 s stalls of single ops (measured: a 128x512x1536 matmul loop, 2 threads, load ~4: median
# 47 ms but p90 510 ms spinning, p90 75-97 ms passive). Passive waiting applies to both sides alike.
# libgomp reads this when torch loads, so it is set before the import; --omp-spin opts out.
if __name__ == "__main__" and "--omp-spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from hf_reference import build_hf_model, hf_batches, hf_generate_batched, hf_warm
from step_split import Timed, instrument, print_split, step_split

import pdserve.engine
from pdserve.engine import Completion, EngineConfig, LLMEngine, SamplingParams
from pdserve.workload.generator import WorkloadRequest, uniform_workload
from pdserve.workload.metrics import itls_during_prefill, percentile

TARGET_SPEEDUP = 1.5
TARGET_ITL_RATIO = 5.0
TARGET_SCHED_SHARE = 0.05
TARGET_LOGIT_DIFF = 1e-3


# ---- helpers ---------------------------------------------------------------------------------------
def log(msg: str = "") -> None:
    print(msg, flush=True)


def load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"load {one:.1f}/{five:.1f}/{fifteen:.1f}"
    except OSError:
        return "load n/a"


def engine_fingerprint() -> str:
    """Short hash of engine/*.py: other people edit the engine, so results name the code they measured."""
    import glob
    import hashlib

    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(os.path.dirname(pdserve.engine.__file__), "*.py"))):
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def new_engine(args: argparse.Namespace, **overrides: Any) -> LLMEngine:
    config = dict(model="bench", dtype="float32", device="cpu", seed=args.seed, torch_threads=args.threads)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def warm_engine(engine: LLMEngine) -> None:
    engine.generate([[7] * 40, [9] * 24], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step_history.clear()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def fill_decode_batch(engine: LLMEngine, workload: list[WorkloadRequest], max_tokens: int) -> None:
    """Add ``workload`` and step until every request has its prompt computed (all in decode)."""
    for req in workload:
        engine.add_request(req.prompt_token_ids, greedy(max_tokens))
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()


def abort_all(engine: LLMEngine) -> None:
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)


# ---- 1. throughput ---------------------------------------------------------------------------------
def engine_prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, through the engine's own scheduler and model runner."""
    rid = engine.add_request(prompt, greedy(1), request_id="engine-bench-logit-check")
    rows = []
    request = engine.get_request(rid)
    assert request is not None
    while request.num_computed_tokens < len(prompt):
        output = engine.scheduler.schedule()
        rows.append(engine.runner.prompt_logits(output))
        engine.scheduler.update_after_step(output)
    engine.abort(rid)
    return torch.cat(rows)


def check_logits(engine: LLMEngine, hf: Any, seed: int) -> tuple[float, float]:
    """The correctness gate: max |logit difference| and argmax agreement of one 96-token prompt."""
    check = uniform_workload(1, (96, 96), (1, 1), seed=seed + 1000)[0].prompt_token_ids
    ours = engine_prompt_logits(engine, check)
    with torch.inference_mode():
        ref = hf(torch.tensor([check])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    argmax_agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    log(
        f"  logit check ({len(check)}-token prompt): max |pdserve - HF| = {diff:.2e}, "
        f"argmax agrees at {100 * argmax_agree:.0f}% of positions"
    )
    return diff, argmax_agree


@dataclass(frozen=True)
class SideBySide:
    """Both sides' run of the throughput workload: timings, outputs, and pdserve's steps and split."""

    ours: Timed
    hf: Timed
    hf_first_half_s: float
    hf_computed_tokens: int  # padding to each batch's longest request included
    completions: list[Completion]
    hf_outputs: list[list[int]]
    steps: list[Any]
    split: dict[str, float]


def run_side_by_side(
    args: argparse.Namespace, engine: LLMEngine, hf: Any, workload: list[WorkloadRequest]
) -> SideBySide:
    """HF runs in two halves (alternate batches) on either side of pdserve, so a change in the machine's
    load during the run weighs on both sides rather than on whichever ran second."""
    useful = sum(r.max_tokens for r in workload)
    batches = hf_batches(workload, args.hf_batch)
    halves = (batches[0::2], batches[1::2])
    hf_out: list[list[int]] = [[] for _ in workload]
    hf_t = Timed()
    log(
        f"  HF generate, first half: batches {', '.join(str(1 + batches.index(b)) for b in halves[0])} of "
        f"{len(batches)} (batches of {args.hf_batch} sorted by prompt length) ... ({load()})"
    )
    with hf_t:
        computed = hf_generate_batched(hf, workload, halves[0], hf_out)
    first_half = hf_t.wall
    log(f"    {first_half:.2f} s ({load()})")

    split = instrument(engine)
    log(f"  pdserve generate, all {len(workload)} requests at once ... ({load()})")
    with Timed() as ours_t:
        completions = engine.generate([r.prompt_token_ids for r in workload], [greedy(r.max_tokens) for r in workload])
    split.unwrap()
    if [len(c.token_ids) for c in completions] != [r.max_tokens for r in workload]:
        raise SystemExit("engine_bench: pdserve returned a different number of tokens than requested")
    steps = list(engine.step_history)
    log(
        f"    {ours_t.wall:.2f} s wall ({ours_t.cpu:.1f} s CPU), {useful / ours_t.wall:.1f} output tok/s, "
        f"{len(steps)} steps, {sum(s.num_preempted for s in steps)} preemptions, {ours_t.ivcsw} involuntary "
        f"context switches ({load()})"
    )

    log(f"  HF generate, second half: the other {len(halves[1])} batches ... ({load()})")
    with hf_t:
        computed += hf_generate_batched(hf, workload, halves[1], hf_out)
    log(f"    {hf_t.wall - first_half:.2f} s ({load()})")
    log(
        f"  HF total: {hf_t.wall:.2f} s wall ({hf_t.cpu:.1f} s CPU), {useful / hf_t.wall:.1f} useful output tok/s "
        f"({computed / hf_t.wall:.1f} tok/s counting padding-to-batch-max), "
        f"{hf_t.ivcsw} involuntary context switches"
    )
    return SideBySide(ours_t, hf_t, first_half, computed, completions, hf_out, steps, step_split(split, steps))


def agreeing_prefix(ours: list[int], theirs: list[int]) -> float:
    """The share of ``theirs`` that ``ours`` repeats from the start."""
    k = 0
    while k < len(theirs) and ours[k] == theirs[k]:
        k += 1
    return k / len(theirs)


def log_step_kinds(steps: list[Any]) -> tuple[list[Any], list[Any]]:
    """Print how pdserve's steps divide into prefill-carrying and decode-only ones; return both lists."""
    prefill_steps = [s for s in steps if s.num_prefill_tokens > 0]
    decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
    log(
        f"    steps with prefill: {len(prefill_steps)}, {sum(s.duration_s for s in prefill_steps):.2f} s "
        f"({sum(s.num_prefill_tokens for s in prefill_steps)} prefill tokens); decode-only steps: "
        f"{len(decode_steps)}, {sum(s.duration_s for s in decode_steps):.2f} s"
    )
    by_width: dict[int, list[float]] = defaultdict(list)
    for s in decode_steps:
        by_width[(s.num_seqs + 15) // 16 * 16].append(s.duration_s)
    if by_width:
        log(
            "    decode-only step time by batch size: "
            + ", ".join(
                f"<={w}: {ms(statistics.median(v))} med ({1000 * statistics.median(v) / w:.2f} ms/seq)"
                for w, v in sorted(by_width.items(), reverse=True)
            )
        )
    return prefill_steps, decode_steps


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    log(
        f"== 1. Throughput: {args.num_requests} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]}, "
        f"outputs {args.output_range[0]}-{args.output_range[1]} tokens, greedy, EOS ignored =="
    )
    workload = uniform_workload(args.num_requests, args.prompt_range, args.output_range, seed=args.seed)
    useful = sum(r.max_tokens for r in workload)
    log(f"  workload: {sum(r.num_prompt_tokens for r in workload)} prompt tokens, {useful} requested output tokens")
    engine = new_engine(args, kv_cache_memory_gb=args.kv_gb)
    c = engine.config
    log(
        f"  pdserve: block_size {c.block_size}, {engine.block_manager.num_blocks} KV blocks, max_num_batched_tokens "
        f"{c.max_num_batched_tokens}, max_num_seqs {c.max_num_seqs}, chunked prefill {c.enable_chunked_prefill}, "
        f"torch threads {torch.get_num_threads()}"
    )
    hf, hf_info = build_hf_model(engine)
    log(
        f"  HF: transformers {hf_info['transformers']}, LlamaForCausalLM, attention "
        f"{hf_info['attn_implementation']}, the engine's weights ({sum(p.numel() for p in hf.parameters()) / 1e6:.2f}M "
        f"params, tie_word_embeddings={hf_info['hf_tie_word_embeddings']})"
    )
    if hf_info["config_tie_word_embeddings"] and not hf_info["engine_lm_head_is_embedding"]:
        log(
            "  NOTE: the preset says tie_word_embeddings=True but the engine's lm_head.weight is a separate "
            "tensor with different values (engine/weights.py build_model: to_empty() unties them); the HF "
            "model is built untied to match what the engine computes"
        )
    diff, argmax_agree = check_logits(engine, hf, args.seed)
    torch.set_num_threads(args.threads)
    warm_engine(engine)
    hf_warm(hf)
    run = run_side_by_side(args, engine, hf, workload)
    ours_s, hf_s = run.ours.wall, run.hf.wall
    pairs = list(zip(run.completions, run.hf_outputs, strict=True))
    same = sum(1 for c, h in pairs if c.token_ids == h)
    prefix = statistics.mean(agreeing_prefix(c.token_ids, h) for c, h in pairs)
    log(
        f"  greedy outputs identical for {same}/{len(workload)} requests; mean agreeing prefix "
        f"{100 * prefix:.1f}% (float32 ties may diverge: informational)"
    )
    log(
        f"  speedup pdserve / HF = {hf_s / ours_s:.2f}x wall (target >= {TARGET_SPEEDUP}x); "
        f"{run.hf.cpu / run.ours.cpu:.2f}x in process CPU time"
    )
    log("  pdserve time split:")
    print_split(run.split)
    prefill_steps, decode_steps = log_step_kinds(run.steps)
    return {
        "num_requests": len(workload),
        "prompt_tokens": sum(r.num_prompt_tokens for r in workload),
        "output_tokens": useful,
        "logit_max_abs_diff": diff,
        "logit_argmax_agreement": argmax_agree,
        "pdserve_s": ours_s,
        "pdserve_cpu_s": run.ours.cpu,
        "pdserve_tok_s": useful / ours_s,
        "hf_s": hf_s,
        "hf_first_half_s": run.hf_first_half_s,
        "hf_cpu_s": run.hf.cpu,
        "cpu_speedup": run.hf.cpu / run.ours.cpu,
        "hf_tok_s": useful / hf_s,
        "hf_batch": args.hf_batch,
        "hf_tokens_incl_padding": run.hf_computed_tokens,
        "speedup": hf_s / ours_s,
        "identical_outputs": same,
        "mean_agreeing_prefix": prefix,
        "pdserve_split": run.split,
        "pdserve_steps": len(run.steps),
        "pdserve_prefill_steps": len(prefill_steps),
        "pdserve_prefill_step_s": sum(s.duration_s for s in prefill_steps),
        "pdserve_decode_step_s": sum(s.duration_s for s in decode_steps),
        "preemptions": sum(s.num_preempted for s in run.steps),
        "kv_cache_memory_gb": args.kv_gb,
        "hf": hf_info,
        "pdserve_involuntary_ctx_switches": run.ours.ivcsw,
        "hf_involuntary_ctx_switches": run.hf.ivcsw,
    }


# ---- 2. interference -------------------------------------------------------------------------------
def interference_engine(args: argparse.Namespace, chunk: int | None) -> LLMEngine:
    max_len = args.long_prompt + 512
    if chunk is None:  # a whole prompt per step: the budget must hold max_model_len
        engine = new_engine(args, max_model_len=max_len, enable_chunked_prefill=False, max_num_batched_tokens=max_len)
    else:  # the chunk size is the step's token budget (decodes first, then a prompt slice)
        engine = new_engine(args, max_model_len=max_len, enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    warm_engine(engine)
    return engine


def interference_trial(args: argparse.Namespace, engine: LLMEngine, trial: int) -> dict[str, Any]:
    """Streams decode; the long prompt arrives; stamp every decode token until the prompt's first token."""
    seed = args.seed * 1000 + 7 + trial  # fresh prompts per trial: no prefix-cache hits
    stream_params = greedy(engine.max_model_len - 128)
    streams = [
        engine.add_request(r.prompt_token_ids, stream_params, request_id=r.request_id)
        for r in uniform_workload(args.streams, (32, 64), (1, 1), seed=seed, prefix=f"stream-{trial}")
    ]
    stamps: dict[str, list[float]] = {rid: [] for rid in streams}

    def step() -> list:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in stamps and o.new_token_ids:
                stamps[o.request_id].append(now)
        return outs

    while min(len(v) for v in stamps.values()) < args.warm_tokens:
        step()
    [long_req] = uniform_workload(
        1, (args.long_prompt, args.long_prompt), (8, 8), seed=seed + 500, prefix=f"long-{trial}"
    )
    first_step = len(engine.step_history)
    t_arrive = time.perf_counter()
    engine.add_request(long_req.prompt_token_ids, greedy(long_req.max_tokens), request_id=long_req.request_id)
    t_first = None
    while t_first is None:
        for o in step():
            if o.request_id == long_req.request_id and o.new_token_ids:
                t_first = time.perf_counter()
    window = list(engine.step_history)[first_step:]
    for _ in range(args.tail_steps):
        step()
    abort_all(engine)

    # the decode tokens of the step that ends the prefill are stamped before t_first: they count as during
    during = itls_during_prefill(stamps.values(), [(t_arrive, t_first)])
    after = [b - a for ts in stamps.values() for a, b in pairwise(ts) if b > t_first]  # decoding alongside
    before = [  # steady decode before it arrived
        b - a for ts in stamps.values() for a, b in pairwise(ts) if b <= t_arrive and a >= ts[min(2, len(ts) - 1)]
    ]
    return {
        "worst_itl_s": max(during),
        "p50_itl_during_s": statistics.median(during),
        "p50_itl_before_s": statistics.median(before) if before else float("nan"),
        "p50_itl_after_s": statistics.median(after) if after else float("nan"),
        "ttft_s": t_first - t_arrive,
        "prefill_steps": len(window),
        "step_s": [round(st.duration_s, 4) for st in window],
        "decode_tokens_during_prefill": sum(1 for ts in stamps.values() for t in ts if t_arrive < t <= t_first),
    }


def bench_interference(args: argparse.Namespace) -> dict[str, Any]:
    log(
        f"== 2. Interference: {args.streams} streaming decodes, then a {args.long_prompt}-token prompt arrives; "
        f"{args.trials} trial(s) per setting, settings interleaved =="
    )
    chunks: list[int | None] = [None, *args.chunks]
    engines = {c: interference_engine(args, c) for c in chunks}
    trials: dict[int | None, list[dict[str, Any]]] = {c: [] for c in chunks}
    for trial in range(args.trials):
        for chunk in chunks:
            r = interference_trial(args, engines[chunk], trial)
            trials[chunk].append(r)
            name = "chunking off" if chunk is None else f"chunk {chunk}"
            log(
                f"  [{trial + 1}/{args.trials}] {name:<12} (budget {engines[chunk].config.max_num_batched_tokens:>5}): "
                f"worst ITL {ms(r['worst_itl_s']):>9}, p50 ITL during prefill {ms(r['p50_itl_during_s']):>9} "
                f"(before {ms(r['p50_itl_before_s'])}, after {ms(r['p50_itl_after_s'])}), TTFT {r['ttft_s']:.2f} s "
                f"in {r['prefill_steps']} steps, slowest step {ms(max(r['step_s']))} ({load()})"
            )
    engines.clear()
    runs = []
    for chunk in chunks:
        t = trials[chunk]
        runs.append(
            {
                "chunk": chunk,
                "worst_itl_s": statistics.median(r["worst_itl_s"] for r in t),
                "worst_itl_each_s": [r["worst_itl_s"] for r in t],
                "p50_itl_during_s": statistics.median(r["p50_itl_during_s"] for r in t),
                "p50_itl_before_s": statistics.median(r["p50_itl_before_s"] for r in t),
                "p50_itl_after_s": statistics.median(r["p50_itl_after_s"] for r in t),
                "ttft_s": statistics.median(r["ttft_s"] for r in t),
                "ttft_each_s": [r["ttft_s"] for r in t],
                "prefill_steps": t[0]["prefill_steps"],
                "trials": t,
            }
        )
    base = runs[0]
    log(
        f"  median over trials: chunking off: worst ITL {ms(base['worst_itl_s'])}, TTFT {base['ttft_s']:.2f} s; "
        f"streams' p50 ITL {ms(base['p50_itl_before_s'])} before vs {ms(base['p50_itl_after_s'])} once the "
        f"{args.long_prompt}-token request decodes with them"
    )
    for r in runs[1:]:
        r["itl_improvement"] = base["worst_itl_s"] / r["worst_itl_s"]
        r["ttft_ratio"] = r["ttft_s"] / base["ttft_s"]
        log(
            f"  median over trials: chunk {r['chunk']}: worst ITL {ms(r['worst_itl_s'])} = "
            f"{r['itl_improvement']:.1f}x lower than unchunked (target >= {TARGET_ITL_RATIO:.0f}x); "
            f"TTFT {r['ttft_s']:.2f} s = {r['ttft_ratio']:.2f}x unchunked"
        )
    return {"streams": args.streams, "long_prompt": args.long_prompt, "trials": args.trials, "runs": runs}


# ---- 3. scheduler overhead -------------------------------------------------------------------------
def bench_scheduler(args: argparse.Namespace) -> dict[str, Any]:
    n = args.sched_requests
    log(
        f"== 3. Scheduler overhead: {n} running requests in decode (prompts {args.sched_prompt_range[0]}-"
        f"{args.sched_prompt_range[1]} tokens), {args.sched_steps} steps =="
    )
    engine = new_engine(args)
    warm_engine(engine)
    fill_decode_batch(
        engine, uniform_workload(n, args.sched_prompt_range, (1, 1), seed=args.seed + 3), args.sched_steps + 64
    )
    split = instrument(engine)
    first = len(engine.step_history)
    for _ in range(args.sched_steps):
        engine.step()
    split.unwrap()
    steps = list(engine.step_history)[first:]
    assert all(st.num_prefill_tokens == 0 and st.num_seqs == n for st in steps), "not a pure decode phase"
    shares = [st.schedule_s / st.duration_s for st in steps]
    d = step_split(split, steps)
    host = [st.duration_s for st in steps]
    non_model = (d["total_s"] - d["forward_s"] - d["logits_s"]) / d["total_s"]
    med_share = statistics.median(shares)
    med_sched = statistics.median(st.schedule_s for st in steps)
    log(
        f"  step time median {ms(statistics.median(host))}, schedule() median {ms(med_sched)}"
        f" (p90 {ms(percentile([st.schedule_s for st in steps], 90))}); share of step: median "
        f"{100 * med_share:.2f}%, p90 {100 * percentile(shares, 90):.2f}% (target <= {100 * TARGET_SCHED_SHARE:.0f}%)"
    )
    log(f"  host-side work outside model forward + lm_head: {100 * non_model:.1f}% of step time; split:")
    print_split(d)
    abort_all(engine)
    return {
        "running": n,
        "steps": len(steps),
        "median_share": med_share,
        "p90_share": percentile(shares, 90),
        "median_schedule_s": med_sched,
        "median_step_s": statistics.median(host),
        "non_model_share": non_model,
        "split": d,
    }


# ---- optional profile ------------------------------------------------------------------------------
PROFILE_GROUPS = {  # shares of all op time: (inclusive ops, self-time ops); SDPA inclusive of the ops it runs
    "scaled_dot_product_attention (inclusive)": (("aten::scaled_dot_product_attention",), ()),
    "linear layers (aten::mm/addmm)": ((), ("aten::mm", "aten::addmm")),
    "KV gather (aten::index/index_select)": ((), ("aten::index", "aten::index_select")),
    "KV write / scatter (aten::index_copy_/_index_put_impl_)": ((), ("aten::index_copy_", "aten::_index_put_impl_")),
}


def bench_profile(args: argparse.Namespace) -> dict[str, Any]:
    """torch.profiler over a few decode steps at the throughput mix's context lengths."""
    from torch.profiler import ProfilerActivity, profile

    log(f"== Profile: {args.num_requests} requests of the throughput mix, all in decode, 3 steps ==")
    engine = new_engine(args, kv_cache_memory_gb=args.kv_gb)
    warm_engine(engine)
    fill_decode_batch(
        engine, uniform_workload(args.num_requests, args.prompt_range, args.output_range, seed=args.seed), 10_000
    )
    for _ in range(2):
        engine.step()
    first = len(engine.step_history)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    steps = list(engine.step_history)[first:]
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    events = {e.key: e for e in prof.key_averages()}
    total = sum(e.self_cpu_time_total for e in events.values())
    shares: dict[str, float] = {}
    for name, (inclusive, own) in PROFILE_GROUPS.items():
        t = sum(events[n].cpu_time_total for n in inclusive if n in events)
        t += sum(events[n].self_cpu_time_total for n in own if n in events)
        shares[name] = t / total
        log(f"  {name:<44} {100 * t / total:5.1f}% of op time")
    math = events.get("aten::_scaled_dot_product_attention_math")
    if math is not None:
        log(
            f"  NOTE: {math.count} SDPA calls ran the unfused math kernel (aten::_scaled_dot_product_attention_math,"
            f" {100 * math.cpu_time_total / total:.1f}% of op time): on CPU the flash kernel needs 4-D inputs"
        )
    shares["sdpa_math_calls"] = math.count if math is not None else 0
    running = engine.scheduler.running
    log(
        f"  step times: {', '.join(ms(st.duration_s) for st in steps)} (under the profiler), "
        f"{steps[0].num_seqs} seqs, context {min(r.num_tokens for r in running)}-"
        f"{max(r.num_tokens for r in running)} tokens"
    )
    abort_all(engine)
    return {"op_shares": shares, "step_s": [st.duration_s for st in steps]}


# ---- main ------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, plus the sizes of every section (smaller with --quick)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload, under a minute")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--profile", action="store_true", help="also torch.profile decode steps of the mix")
    parser.add_argument(
        "--only",
        choices=("throughput", "interference", "scheduler"),
        action="append",
        help="run only these sections (repeatable)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument(
        "--omp-spin", action="store_true", help="leave OMP_WAIT_POLICY unset (OpenMP threads spin); default: PASSIVE"
    )
    parser.add_argument("--trials", type=int, default=None, help="interference trials per setting (3; quick 1)")
    args = parser.parse_args(argv)
    q = args.quick
    args.num_requests = args.num_requests or (32 if q else 64)  # at least 2 HF batches: one per half
    args.prompt_range = (32, 128) if q else (32, 512)
    args.output_range = (16, 48) if q else (32, 256)
    args.kv_gb = 1.0  # 4096 blocks of 16 tokens: the whole mix fits, no preemption
    args.streams = 16
    args.long_prompt = 2048 if q else 4096
    args.chunks = [128, 256] if q else [256, 512]  # 1/16 and 1/8 of the long prompt
    args.trials = args.trials or (1 if q else 3)
    args.warm_tokens = 4 if q else 6
    args.tail_steps = 2 if q else 4
    args.sched_requests = 64
    args.sched_prompt_range = (16, 32)
    args.sched_steps = 12 if q else 40
    return args


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """``(metric, value, target, PASS/MISS/info)`` for every section that ran."""
    rows: list[tuple[str, str, str, str]] = []
    if "throughput" in results:
        t = results["throughput"]
        diff, speedup = t["logit_max_abs_diff"], t["speedup"]
        rows.append(
            (
                "logits vs HF, max |diff|",
                f"{diff:.1e}",
                f"<= {TARGET_LOGIT_DIFF:.0e}",
                verdict(diff <= TARGET_LOGIT_DIFF),
            )
        )
        rows.append(
            (
                f"throughput pdserve / HF ({t['pdserve_tok_s']:.0f} vs {t['hf_tok_s']:.0f} tok/s)",
                f"{speedup:.2f}x",
                f">= {TARGET_SPEEDUP}x",
                verdict(speedup >= TARGET_SPEEDUP),
            )
        )
    if "interference" in results:
        runs = results["interference"]["runs"]
        for r in runs[1:]:
            rows.append(
                (
                    f"worst ITL off/chunk {r['chunk']} ({ms(runs[0]['worst_itl_s'])} / {ms(r['worst_itl_s'])})",
                    f"{r['itl_improvement']:.1f}x",
                    f">= {TARGET_ITL_RATIO:.0f}x",
                    verdict(r["itl_improvement"] >= TARGET_ITL_RATIO),
                )
            )
        for r in runs:
            name = "off" if r["chunk"] is None else f"chunk {r['chunk']}"
            rows.append((f"long-prompt TTFT, {name}", f"{r['ttft_s']:.2f} s", "-", "info"))
    if "scheduler" in results:
        s = results["scheduler"]
        rows.append(
            (
                f"schedule share of step, {s['running']} running (median)",
                f"{100 * s['median_share']:.2f}%",
                f"<= {100 * TARGET_SCHED_SHARE:.0f}%",
                verdict(s["median_share"] <= TARGET_SCHED_SHARE),
            )
        )
        rows.append(("host work outside model forward, same steps", f"{100 * s['non_model_share']:.1f}%", "-", "info"))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    fingerprint = engine_fingerprint()
    log(
        f"pdserve engine bench{' (--quick)' if args.quick else ''}: torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, engine/*.py sha256 {fingerprint}, "
        f"{load()}"
    )
    started = time.perf_counter()
    results: dict[str, Any] = {
        "quick": args.quick,
        "threads": args.threads,
        "seed": args.seed,
        "torch": torch.__version__,
        "engine_sha256": fingerprint,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    sections = {"throughput": bench_throughput, "interference": bench_interference, "scheduler": bench_scheduler}
    for name in args.only or list(sections):
        results[name] = sections[name](args)
        log()
    if args.profile:
        results["profile"] = bench_profile(args)
        log()
    rows = summary_rows(results)
    results["summary"] = [dict(zip(("metric", "value", "target", "result"), r, strict=True)) for r in rows]
    results["wall_s"] = time.perf_counter() - started
    width = max(len(r[0]) for r in rows) if rows else 10
    log(f"== Summary ({results['wall_s']:.0f} s, {load()}) ==")
    log(f"  {'metric':<{width}}  {'value':>10}  {'target':>8}  result")
    for metric, value, target, result in rows:
        log(f"  {metric:<{width}}  {value:>10}  {target:>8}  {result}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        log(f"  figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
