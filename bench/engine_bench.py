"""Single-engine benchmark: pdserve's LLMEngine against Hugging Face ``generate``, in one process.

Three measurements, side by side in one run (the machines are shared: never compare across runs):

1. Throughput: output tokens/s of ``LLMEngine.generate`` vs ``transformers`` ``generate`` on the SAME
   weights (the ``bench`` preset loaded into a ``LlamaForCausalLM``), the same seeded mix of requests,
   greedy, EOS ignored. ``generate`` is batched as a user would: sorted by prompt length, batches of 16,
   left padding, ``max_new_tokens`` = the batch's largest request; only each request's own requested
   tokens count. Logits of one prompt are compared first.
2. Interference: 16 streaming decodes, then a long prompt arrives. Worst inter-token latency of the
   decodes while the long prompt prefills, and the long prompt's TTFT, with chunked prefill off and on.
3. Scheduler overhead: 64 running requests in decode; ``schedule_s / duration_s`` per step (median),
   plus where the rest of the host-side step time goes.

    python bench/engine_bench.py [--quick] [--json PATH] [--profile]

It is a benchmark, not a test: it prints figures and a summary with targets, and exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/engine_bench.py` from anywhere
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

PAD_TOKEN = 258  # reserved in the byte tokenizer: decodes to nothing, never a prompt token here
TARGET_SPEEDUP = 1.5
TARGET_ITL_RATIO = 5.0
TARGET_SCHED_SHARE = 0.05
TARGET_LOGIT_DIFF = 1e-3


# ---- helpers ---------------------------------------------------------------------------------------
def log(msg: str = "") -> None:
    print(msg, flush=True)


def load() -> str:
    try:
        return "load %.1f/%.1f/%.1f" % os.getloadavg()
    except OSError:
        return "load n/a"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


def make_workload(n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
                  ) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids in [0, 256), max_tokens) pairs, seeded."""
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


class Split:
    """Wall time accumulated per label by wrapping bound methods of one object (in-process only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str]] = []

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        object.__setattr__(obj, attr, timed)  # an instance attribute shadows the method
        self._undo.append((obj, attr))

    def unwrap(self) -> None:
        for obj, attr in reversed(self._undo):
            try:
                object.__delattr__(obj, attr)
            except AttributeError:
                pass
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(engine: LLMEngine) -> Split:
    split = Split()
    split.wrap(engine.runner, "run", "runner.run")
    split.wrap(engine.runner, "_prepare", "prepare")
    split.wrap(engine.runner.model, "forward", "forward")
    split.wrap(engine.runner.model, "logits", "logits")
    split.wrap(engine.scheduler, "update_after_step", "update_after_step")
    return split


def step_split(engine: LLMEngine, split: Split, steps: list) -> dict[str, float]:
    """Where the time of ``steps`` went (seconds): schedule, prepare, forward, logits+sample, post."""
    total = sum(s.duration_s for s in steps)
    sched = sum(s.schedule_s for s in steps)
    run = split.seconds["runner.run"]
    prepare, forward, logits = split.seconds["prepare"], split.seconds["forward"], split.seconds["logits"]
    return {
        "total_s": total,
        "schedule_s": sched,
        "prepare_s": prepare,
        "forward_s": forward,
        "logits_sample_s": max(0.0, run - prepare - forward),
        "logits_s": logits,
        "post_s": max(0.0, total - sched - run),  # update_after_step, append, detokenize, outputs
        "update_after_step_s": split.seconds["update_after_step"],
    }


def print_split(d: dict[str, float], indent: str = "    ") -> None:
    total = d["total_s"] or float("nan")
    for key, name in (("schedule_s", "schedule"), ("prepare_s", "prepare inputs (runner._prepare)"),
                      ("forward_s", "model forward"), ("logits_sample_s", "logits + sample"),
                      ("post_s", "post-step (update_after_step, append, outputs)")):
        log(f"{indent}{name:<48} {d[key]:8.2f} s  {100 * d[key] / total:5.1f}%")
    log(f"{indent}{'   of which update_after_step':<48} {d['update_after_step_s']:8.2f} s  "
        f"{100 * d['update_after_step_s'] / total:5.1f}%")


def new_engine(args: argparse.Namespace, **overrides: Any) -> LLMEngine:
    config = dict(model="bench", dtype="float32", device="cpu", seed=args.seed, torch_threads=args.threads)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def warm_engine(engine: LLMEngine) -> None:
    engine.generate([[7] * 40, [9] * 24], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step_history.clear()


# ---- 1. throughput ---------------------------------------------------------------------------------
def build_hf_model(engine: LLMEngine):
    import transformers

    transformers.logging.set_verbosity_error()
    mc = engine.model_config
    if mc.rope_scaling:
        raise SystemExit("engine_bench: the HF comparison supports plain RoPE only")
    config = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings, rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta, tie_word_embeddings=mc.tie_word_embeddings, attention_bias=mc.attention_bias,
        bos_token_id=None, eos_token_id=None, pad_token_id=PAD_TOKEN,
    )
    hf = transformers.LlamaForCausalLM(config)
    state = engine.runner.model.state_dict()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"engine_bench: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf = hf.to(dtype=engine.dtype).eval()
    if mc.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr() or torch.equal(
            hf.lm_head.weight, hf.model.embed_tokens.weight)
    gc = hf.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, PAD_TOKEN
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    return hf, transformers.__version__, getattr(config, "_attn_implementation", "?")


def engine_prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, through the engine's own scheduler and model runner."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                             request_id="engine-bench-logit-check")
    rows = []
    request = engine.get_request(rid)
    while request.num_computed_tokens < len(prompt):
        output = engine.scheduler.schedule()
        rows.append(engine.runner.prompt_logits(output))
        engine.scheduler.update_after_step(output)
    engine.abort(rid)
    return torch.cat(rows)


def hf_generate_batched(hf, workload: list[tuple[list[int], int]], batch_size: int) -> tuple[list[list[int]], dict]:
    order = sorted(range(len(workload)), key=lambda i: len(workload[i][0]))
    outputs: list[list[int]] = [[] for _ in workload]
    computed = 0
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(workload[i][0]) for i in idx)
        new = max(workload[i][1] for i in idx)
        ids = torch.tensor([[PAD_TOKEN] * (width - len(workload[i][0])) + workload[i][0] for i in idx])
        mask = torch.tensor([[0] * (width - len(workload[i][0])) + [1] * len(workload[i][0]) for i in idx])
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN)
        if out.shape[1] != width + new:
            raise SystemExit(f"engine_bench: HF generate stopped early ({out.shape[1] - width} of {new} tokens)")
        for row, i in enumerate(idx):
            outputs[i] = out[row, width : width + workload[i][1]].tolist()
        computed += len(idx) * new
    return outputs, {"generated_tokens_incl_waste": computed}


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    log(f"== 1. Throughput: {args.num_requests} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]}, "
        f"outputs {args.output_range[0]}-{args.output_range[1]} tokens, greedy, EOS ignored ==")
    workload = make_workload(args.num_requests, args.seed, args.prompt_range, args.output_range)
    useful = sum(n for _, n in workload)
    log(f"  workload: {sum(len(p) for p, _ in workload)} prompt tokens, {useful} requested output tokens")

    engine = new_engine(args, kv_cache_memory_gb=args.kv_gb)
    log(f"  pdserve: block_size {engine.config.block_size}, {engine.block_manager.num_blocks} KV blocks, "
        f"max_num_batched_tokens {engine.config.max_num_batched_tokens}, max_num_seqs {engine.config.max_num_seqs}, "
        f"chunked prefill {engine.config.enable_chunked_prefill}, torch threads {torch.get_num_threads()}")
    hf, hf_version, attn_impl = build_hf_model(engine)
    log(f"  HF: transformers {hf_version}, LlamaForCausalLM, attention {attn_impl}, same weights "
        f"({sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M params)")

    # Correctness gate: the two models must agree before timing means anything.
    check = make_workload(1, args.seed + 1000, (96, 96), (1, 1))[0][0]
    ours = engine_prompt_logits(engine, check)
    with torch.inference_mode():
        ref = hf(torch.tensor([check])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    argmax_agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    log(f"  logit check ({len(check)}-token prompt): max |pdserve - HF| = {diff:.2e}, "
        f"argmax agrees at {100 * argmax_agree:.0f}% of positions")

    torch.set_num_threads(args.threads)
    warm_engine(engine)
    with torch.inference_mode():
        hf.generate(input_ids=torch.tensor([[5] * 32]), max_new_tokens=4, do_sample=False,
                    eos_token_id=None, pad_token_id=PAD_TOKEN)

    split = instrument(engine)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in workload]
    log(f"  pdserve generate ... ({load()})")
    c0, t0 = time.process_time(), time.perf_counter()
    completions = engine.generate([p for p, _ in workload], params)
    ours_s, ours_cpu = time.perf_counter() - t0, time.process_time() - c0
    split.unwrap()
    got = [len(c.token_ids) for c in completions]
    if got != [n for _, n in workload]:
        raise SystemExit("engine_bench: pdserve returned a different number of tokens than requested")
    steps = list(engine.step_history)
    d = step_split(engine, split, steps)
    log(f"    {ours_s:.2f} s wall ({ours_cpu:.1f} s CPU), {useful / ours_s:.1f} output tok/s, {len(steps)} steps, "
        f"{sum(s.num_preempted for s in steps)} preemptions ({load()})")

    log(f"  HF generate, batches of {args.hf_batch} sorted by prompt length ... ({load()})")
    c0, t0 = time.process_time(), time.perf_counter()
    hf_out, hf_info = hf_generate_batched(hf, workload, args.hf_batch)
    hf_s, hf_cpu = time.perf_counter() - t0, time.process_time() - c0
    log(f"    {hf_s:.2f} s wall ({hf_cpu:.1f} s CPU), {useful / hf_s:.1f} useful output tok/s "
        f"({hf_info['generated_tokens_incl_waste'] / hf_s:.1f} tok/s counting padding-to-batch-max) ({load()})")

    speedup = hf_s / ours_s
    same = sum(1 for c, h in zip(completions, hf_out, strict=True) if c.token_ids == h)
    prefix = []
    for c, h in zip(completions, hf_out, strict=True):
        k = 0
        while k < len(h) and c.token_ids[k] == h[k]:
            k += 1
        prefix.append(k / len(h))
    log(f"  greedy outputs identical for {same}/{len(workload)} requests; mean agreeing prefix "
        f"{100 * statistics.mean(prefix):.1f}% (float32 ties may diverge: informational)")
    log(f"  speedup pdserve / HF = {speedup:.2f}x (target >= {TARGET_SPEEDUP}x)")

    prefill_steps = [s for s in steps if s.num_prefill_tokens > 0]
    decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
    log("  pdserve time split:")
    print_split(d)
    log(f"    steps with prefill: {len(prefill_steps)}, {sum(s.duration_s for s in prefill_steps):.2f} s "
        f"({sum(s.num_prefill_tokens for s in prefill_steps)} prefill tokens); decode-only steps: "
        f"{len(decode_steps)}, {sum(s.duration_s for s in decode_steps):.2f} s")
    by_width: dict[int, list[float]] = defaultdict(list)
    for s in decode_steps:
        by_width[(s.num_seqs + 15) // 16 * 16].append(s.duration_s)
    if by_width:
        log("    decode-only step time by batch size: " + ", ".join(
            f"<={w}: {ms(statistics.median(v))} med ({1000 * statistics.median(v) / w:.2f} ms/seq)"
            for w, v in sorted(by_width.items(), reverse=True)))
    return {
        "num_requests": len(workload), "prompt_tokens": sum(len(p) for p, _ in workload),
        "output_tokens": useful, "logit_max_abs_diff": diff, "logit_argmax_agreement": argmax_agree,
        "pdserve_s": ours_s, "pdserve_cpu_s": ours_cpu, "pdserve_tok_s": useful / ours_s,
        "hf_s": hf_s, "hf_cpu_s": hf_cpu, "hf_tok_s": useful / hf_s, "hf_batch": args.hf_batch,
        "hf_tokens_incl_padding": hf_info["generated_tokens_incl_waste"], "speedup": speedup,
        "identical_outputs": same, "mean_agreeing_prefix": statistics.mean(prefix),
        "pdserve_split": d, "pdserve_steps": len(steps), "pdserve_prefill_steps": len(prefill_steps),
        "pdserve_prefill_step_s": sum(s.duration_s for s in prefill_steps),
        "pdserve_decode_step_s": sum(s.duration_s for s in decode_steps),
        "preemptions": sum(s.num_preempted for s in steps),
        "kv_cache_memory_gb": args.kv_gb, "transformers": hf_version, "hf_attn_implementation": attn_impl,
    }


# ---- 2. interference -------------------------------------------------------------------------------
def run_interference(args: argparse.Namespace, chunk: int | None) -> dict[str, Any]:
    max_len = args.long_prompt + 512
    if chunk is None:
        engine = new_engine(args, max_model_len=max_len, enable_chunked_prefill=False, max_num_batched_tokens=max_len)
    else:
        engine = new_engine(args, max_model_len=max_len, enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    warm_engine(engine)
    rng = random.Random(args.seed + 7)
    stream_params = SamplingParams(max_tokens=max_len - 128, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request([rng.randrange(256) for _ in range(rng.randint(32, 64))], stream_params,
                                  request_id=f"stream-{i}") for i in range(args.streams)]
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
    long_prompt = [rng.randrange(256) for _ in range(args.long_prompt)]
    first_step = len(engine.step_history)
    t_arrive = time.perf_counter()
    engine.add_request(long_prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       request_id="long")
    t_first = None
    while t_first is None:
        for o in step():
            if o.request_id == "long" and o.new_token_ids:
                t_first = time.perf_counter()
    window_steps = list(engine.step_history)[first_step:]
    for _ in range(args.tail_steps):
        step()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)

    during, before = [], []
    for ts in stamps.values():
        for a, b in zip(ts, ts[1:]):
            if b > t_arrive and a < t_first:
                during.append(b - a)
            elif b <= t_arrive:
                before.append(b - a)
    tokens_during = sum(1 for ts in stamps.values() for t in ts if t_arrive < t <= t_first)
    return {
        "chunk": chunk, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "enable_chunked_prefill": engine.config.enable_chunked_prefill,
        "worst_itl_s": max(during), "p50_itl_during_s": statistics.median(during),
        "p50_itl_before_s": statistics.median(before) if before else float("nan"),
        "ttft_s": t_first - t_arrive, "prefill_steps": len(window_steps),
        "max_step_s": max(s.duration_s for s in window_steps),
        "decode_tokens_during_prefill": tokens_during,
    }


def bench_interference(args: argparse.Namespace) -> dict[str, Any]:
    log(f"== 2. Interference: {args.streams} streaming decodes, then a {args.long_prompt}-token prompt arrives ==")
    runs = []
    for chunk in [None, *args.chunks]:
        r = run_interference(args, chunk)
        runs.append(r)
        name = "chunking off" if chunk is None else f"chunk {chunk}"
        log(f"  {name:<13} (budget {r['max_num_batched_tokens']:>5}): worst ITL {ms(r['worst_itl_s']):>10}, "
            f"p50 ITL during prefill {ms(r['p50_itl_during_s']):>9} (before: {ms(r['p50_itl_before_s'])}), "
            f"long-prompt TTFT {r['ttft_s']:.2f} s over {r['prefill_steps']} steps, "
            f"{r['decode_tokens_during_prefill']} decode tokens meanwhile ({load()})")
    base = runs[0]["worst_itl_s"]
    for r in runs[1:]:
        r["itl_improvement"] = base / r["worst_itl_s"]
        r["ttft_ratio"] = r["ttft_s"] / runs[0]["ttft_s"]
        log(f"  chunk {r['chunk']}: worst ITL {r['itl_improvement']:.1f}x lower than unchunked "
            f"(target >= {TARGET_ITL_RATIO}x); TTFT {r['ttft_ratio']:.2f}x of unchunked")
    return {"streams": args.streams, "long_prompt": args.long_prompt, "runs": runs}


# ---- 3. scheduler overhead -------------------------------------------------------------------------
def bench_scheduler(args: argparse.Namespace) -> dict[str, Any]:
    n = args.sched_requests
    log(f"== 3. Scheduler overhead: {n} running requests in decode, {args.sched_steps} steps ==")
    engine = new_engine(args)
    warm_engine(engine)
    workload = make_workload(n, args.seed + 3, (64, 128), (1, 1))
    params = SamplingParams(max_tokens=args.sched_steps + 64, temperature=0.0, ignore_eos=True)
    for prompt, _ in workload:
        engine.add_request(prompt, params)
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()
    split = instrument(engine)
    first = len(engine.step_history)
    for _ in range(args.sched_steps):
        engine.step()
    split.unwrap()
    steps = list(engine.step_history)[first:]
    assert all(st.num_prefill_tokens == 0 and st.num_seqs == n for st in steps), "not a pure decode phase"
    shares = [st.schedule_s / st.duration_s for st in steps]
    d = step_split(engine, split, steps)
    host = [st.duration_s for st in steps]
    non_model = (d["total_s"] - d["forward_s"] - d["logits_s"]) / d["total_s"]
    med_share = statistics.median(shares)
    log(f"  step time median {ms(statistics.median(host))}, schedule() median {ms(statistics.median(st.schedule_s for st in steps))}"
        f" (p90 {ms(pct([st.schedule_s for st in steps], 0.9))}); share of step: median {100 * med_share:.2f}%, "
        f"p90 {100 * pct(shares, 0.9):.2f}% (target <= {100 * TARGET_SCHED_SHARE:.0f}%)")
    log(f"  host-side work outside model forward + lm_head: {100 * non_model:.1f}% of step time; split:")
    print_split(d)
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return {"running": n, "steps": len(steps), "median_share": med_share, "p90_share": pct(shares, 0.9),
            "median_schedule_s": statistics.median(st.schedule_s for st in steps),
            "median_step_s": statistics.median(host), "non_model_share": non_model, "split": d}


# ---- optional profile ------------------------------------------------------------------------------
def bench_profile(args: argparse.Namespace) -> dict[str, Any]:
    """torch.profiler over a few decode steps at the throughput mix's context lengths."""
    from torch.profiler import ProfilerActivity, profile

    log(f"== Profile: {args.num_requests} requests of the throughput mix, all in decode, 3 steps ==")
    engine = new_engine(args, kv_cache_memory_gb=args.kv_gb)
    warm_engine(engine)
    workload = make_workload(args.num_requests, args.seed, args.prompt_range, args.output_range)
    for prompt, _ in workload:
        engine.add_request(prompt, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()
    for _ in range(2):
        engine.step()
    first = len(engine.step_history)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    steps = list(engine.step_history)[first:]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    log(table)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    groups = {"gather (aten::index / index_select)": ("aten::index", "aten::index_select"),
              "attention (sdpa)": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                   "aten::_scaled_dot_product_attention_math"),
              "matmul (aten::mm/addmm/bmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
              "KV write (index_put)": ("aten::_index_put_impl_",)}
    shares = {}
    for name, ops in groups.items():
        t = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ops)
        shares[name] = t / total
        log(f"  {name:<40} {100 * t / total:5.1f}% of op time")
    log(f"  step times: {', '.join(ms(st.duration_s) for st in steps)} (under the profiler), "
        f"{steps[0].num_seqs} seqs, context {min(r.num_tokens for r in s.running)}-{max(r.num_tokens for r in s.running)}")
    for rid in list(s.requests):
        engine.abort(rid)
    return {"op_shares": shares, "step_s": [st.duration_s for st in steps]}


# ---- main ------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload, under a minute")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--profile", action="store_true", help="also torch.profile decode steps of the mix")
    parser.add_argument("--only", choices=("throughput", "interference", "scheduler"), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--hf-batch", type=int, default=16)
    args = parser.parse_args(argv)

    args.num_requests = args.num_requests or (16 if args.quick else 64)
    args.prompt_range = (32, 256) if args.quick else (32, 512)
    args.output_range = (16, 64) if args.quick else (32, 256)
    args.kv_gb = 1.0
    args.streams = 16
    args.long_prompt = 4096
    args.chunks = [256, 512]
    args.warm_tokens = 4 if args.quick else 8
    args.tail_steps = 2 if args.quick else 4
    args.sched_requests = 64
    args.sched_steps = 12 if args.quick else 40
    sections = args.only or ["throughput", "interference", "scheduler"]

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log(f"pdserve engine bench{' (--quick)' if args.quick else ''}: torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, Python {platform.python_version()}, {load()}")
    started = time.perf_counter()
    results: dict[str, Any] = {"quick": args.quick, "threads": args.threads, "seed": args.seed,
                               "torch": torch.__version__}
    if "throughput" in sections:
        results["throughput"] = bench_throughput(args)
        log()
    if "interference" in sections:
        results["interference"] = bench_interference(args)
        log()
    if "scheduler" in sections:
        results["scheduler"] = bench_scheduler(args)
        log()
    if args.profile:
        results["profile"] = bench_profile(args)
        log()

    rows: list[tuple[str, str, str, str]] = []
    if "throughput" in results:
        t = results["throughput"]
        rows.append(("logits vs HF, max |diff|", f"{t['logit_max_abs_diff']:.1e}", f"<= {TARGET_LOGIT_DIFF:.0e}",
                     verdict(t["logit_max_abs_diff"] <= TARGET_LOGIT_DIFF)))
        rows.append((f"throughput pdserve / HF ({t['pdserve_tok_s']:.0f} vs {t['hf_tok_s']:.0f} tok/s)",
                     f"{t['speedup']:.2f}x", f">= {TARGET_SPEEDUP}x", verdict(t["speedup"] >= TARGET_SPEEDUP)))
    if "interference" in results:
        runs = results["interference"]["runs"]
        for r in runs[1:]:
            rows.append((f"worst ITL off/chunk {r['chunk']} ({ms(runs[0]['worst_itl_s'])} / {ms(r['worst_itl_s'])})",
                         f"{r['itl_improvement']:.1f}x", f">= {TARGET_ITL_RATIO:.0f}x",
                         verdict(r["itl_improvement"] >= TARGET_ITL_RATIO)))
        for r in runs:
            name = "off" if r["chunk"] is None else f"chunk {r['chunk']}"
            rows.append((f"long-prompt TTFT, {name}", f"{r['ttft_s']:.2f} s", "-", "info"))
    if "scheduler" in results:
        s = results["scheduler"]
        rows.append((f"schedule share of step, {s['running']} running (median)", f"{100 * s['median_share']:.2f}%",
                     f"<= {100 * TARGET_SCHED_SHARE:.0f}%", verdict(s["median_share"] <= TARGET_SCHED_SHARE)))
        rows.append(("host work outside model forward, same steps", f"{100 * s['non_model_share']:.1f}%", "-", "info"))
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
