"""Single-engine benchmark: pdserve's LLMEngine against Hugging Face ``generate``, in one process.

Three measurements, side by side in one run (the machines are shared: never compare across runs):

1. Throughput: output tokens/s of ``LLMEngine.generate`` vs ``transformers`` ``generate`` on the SAME
   weights (the ``bench`` preset loaded into a ``LlamaForCausalLM``), the same seeded mix of requests
   (64; prompts 32-512, outputs 32-256 tokens, ids in [0, 256)), greedy, EOS ignored. ``generate`` is
   batched as a user would: sorted by prompt length, batches of 16, left padding with an attention mask,
   ``max_new_tokens`` = the batch's largest request; only each request's own requested tokens count.
   Logits of one prompt are compared first. HF runs half its batches before pdserve and half after.
   Target: pdserve >= 1.5x.
2. Interference: 16 streaming decodes, then a 4096-token prompt arrives. Worst inter-token latency of the
   decodes while it prefills, and its TTFT, with chunked prefill off and with chunks of 256 and 512
   (the step's token budget); 3 interleaved trials per setting, medians. Target: worst ITL >= 5x lower.
3. Scheduler overhead: 64 running requests in decode; ``schedule_s / duration_s`` per step (median),
   plus where the rest of the step goes. Target: <= 5%.

    python bench/engine_bench.py [--quick] [--json PATH] [--profile] [--only SECTION] [--threads N]

``--quick`` (under a minute): 32 requests with shorter prompts/outputs, a 2048-token prompt with chunks
of 128/256, one trial. torch uses 2 threads on both sides; OMP_WAIT_POLICY=PASSIVE unless --omp-spin.
It is a benchmark, not a test: it prints figures and a summary with targets, and exits 0 either way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

# On a shared 2-core machine, OpenMP threads that spin at barriers turn other people's load into
# 0.5-1 s stalls of single ops (measured: a 128x512x1536 matmul loop, 2 threads, load ~4: median
# 47 ms but p90 510 ms spinning, p90 75-97 ms passive). Passive waiting applies to both sides alike.
# libgomp reads this when torch loads, so it is set before the import; --omp-spin opts out.
if __name__ == "__main__" and "--omp-spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pdserve.engine
import torch
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

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


def ivcsw() -> int:
    """Involuntary context switches of this process so far: a sign of other load on the machine."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    except (ImportError, OSError):
        return 0


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def make_workload(
    n: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids in [0, 256), max_tokens) pairs, seeded."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range)) for _ in range(n)
    ]


class Split:
    """Wall time accumulated per label by wrapping bound methods of one object (in-process only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:  # the engine changed shape: time what is still there
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        own = attr in getattr(obj, "__dict__", {})  # else a method: an instance attribute shadows it
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn if own else None))

    def unwrap(self) -> None:
        for obj, attr, original in reversed(self._undo):
            if original is not None:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


# Optional, engine-version-specific methods of each layer's Attention: timed when they exist.
ATTENTION_PARTS = (
    ("_decode_attention", "decode attention"),
    ("_prefill_attention", "prefill attention"),
    ("_context", "KV gather (Attention._context)"),
)


def instrument(engine: LLMEngine) -> Split:
    """Time the parts of a step. Only attribute lookups are redirected; nothing in engine/ changes."""
    split = Split()
    split.wrap(engine.runner, "run", "runner.run")
    split.wrap(engine.runner, "_prepare", "prepare")
    split.wrap(engine.runner.model, "forward", "forward")
    split.wrap(engine.runner.model, "logits", "logits")
    split.wrap(engine.scheduler, "update_after_step", "update_after_step")
    for layer in getattr(engine.runner.model.model, "layers", []):
        split.wrap(layer.self_attn, "forward", "attention block")
        split.wrap(layer.mlp, "forward", "mlp")
        for attr, label in ATTENTION_PARTS:
            split.wrap(layer.self_attn, attr, label)
    split.wrap(torch.nn.functional, "scaled_dot_product_attention", "sdpa")  # module-level: undone by unwrap
    return split


def step_split(engine: LLMEngine, split: Split, steps: list) -> dict[str, float]:
    """Where the time of ``steps`` went (seconds)."""
    total = sum(s.duration_s for s in steps)
    sched = sum(s.schedule_s for s in steps)
    sec = split.seconds
    run, prepare, forward = sec["runner.run"], sec["prepare"], sec["forward"]
    d = {
        "total_s": total,
        "schedule_s": sched,
        "prepare_s": prepare,
        "forward_s": forward,
        "attention_block_s": sec["attention block"],
        "sdpa_s": sec["sdpa"],
        "mlp_s": sec["mlp"],
        "logits_sample_s": max(0.0, run - prepare - forward),
        "logits_s": sec["logits"],
        "post_s": max(0.0, total - sched - run),  # update_after_step, append, detokenize, outputs
        "update_after_step_s": sec["update_after_step"],
    }
    for _, label in ATTENTION_PARTS:
        if split.calls.get(label):
            d[label] = sec[label]
    return d


def print_split(d: dict[str, float], indent: str = "    ") -> None:
    total = d["total_s"] or float("nan")
    rows = [
        ("schedule_s", "schedule"),
        ("prepare_s", "prepare inputs (runner._prepare)"),
        ("forward_s", "model forward"),
        ("attention_block_s", "  attention layers (qkv/o proj, rope, KV, attn)"),
    ]
    rows += [(label, f"    {label}") for _, label in ATTENTION_PARTS if label in d]
    rows += [
        ("sdpa_s", "    scaled_dot_product_attention calls"),
        ("mlp_s", "  MLP layers"),
        ("logits_sample_s", "logits + sample"),
        ("post_s", "post-step (update_after_step, append, outputs)"),
        ("update_after_step_s", "  of which update_after_step"),
    ]
    for key, name in rows:
        log(f"{indent}{name:<48} {d[key]:8.2f} s  {100 * d[key] / total:5.1f}%")


def new_engine(args: argparse.Namespace, **overrides: Any) -> LLMEngine:
    config = dict(model="bench", dtype="float32", device="cpu", seed=args.seed, torch_threads=args.threads)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def warm_engine(engine: LLMEngine) -> None:
    engine.generate([[7] * 40, [9] * 24], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step_history.clear()


# ---- 1. throughput ---------------------------------------------------------------------------------
def build_hf_model(engine: LLMEngine) -> tuple[Any, dict[str, Any]]:
    """A transformers ``LlamaForCausalLM`` holding exactly the engine model's weights."""
    import transformers

    transformers.logging.set_verbosity_error()
    mc = engine.model_config
    if mc.rope_scaling:
        raise SystemExit("engine_bench: the HF comparison supports plain RoPE only")
    ours = engine.runner.model
    # Mirror what the engine really computes with: its lm_head may not be the embedding even when the
    # config says tied (engine/weights.py unties them); then the HF model is built untied too.
    shared = ours.lm_head.weight is ours.model.embed_tokens.weight
    same_values = torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    tie = bool(mc.tie_word_embeddings and (shared or same_values))
    config = transformers.LlamaConfig(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta,
        tie_word_embeddings=tie,
        attention_bias=mc.attention_bias,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN,
    )
    hf = transformers.LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"engine_bench: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf = hf.to(dtype=engine.dtype).eval()
    for name, tensor in ours.state_dict().items():
        if not torch.equal(hf.state_dict()[name], tensor):
            raise SystemExit(f"engine_bench: HF weight {name} differs from the engine's after loading")
    gc = hf.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, PAD_TOKEN
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    info = {
        "transformers": transformers.__version__,
        "attn_implementation": getattr(config, "_attn_implementation", "?"),
        "config_tie_word_embeddings": mc.tie_word_embeddings,
        "engine_lm_head_is_embedding": shared,
        "hf_tie_word_embeddings": tie,
    }
    return hf, info


def engine_prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, through the engine's own scheduler and model runner."""
    rid = engine.add_request(
        prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id="engine-bench-logit-check"
    )
    rows = []
    request = engine.get_request(rid)
    while request.num_computed_tokens < len(prompt):
        output = engine.scheduler.schedule()
        rows.append(engine.runner.prompt_logits(output))
        engine.scheduler.update_after_step(output)
    engine.abort(rid)
    return torch.cat(rows)


def hf_batches(workload: list[tuple[list[int], int]], batch_size: int) -> list[list[int]]:
    """Request indices, sorted by prompt length, cut into batches: what a user of ``generate`` would do."""
    order = sorted(range(len(workload)), key=lambda i: len(workload[i][0]))
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


def hf_generate_batched(
    hf, workload: list[tuple[list[int], int]], batches: list[list[int]], outputs: list[list[int]]
) -> int:
    """Run ``batches`` through ``generate``; fill ``outputs``; return the tokens computed (padding included)."""
    computed = 0
    for idx in batches:
        width = max(len(workload[i][0]) for i in idx)
        new = max(workload[i][1] for i in idx)
        ids = torch.tensor([[PAD_TOKEN] * (width - len(workload[i][0])) + workload[i][0] for i in idx])
        mask = torch.tensor([[0] * (width - len(workload[i][0])) + [1] * len(workload[i][0]) for i in idx])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN,
            )
        if out.shape[1] != width + new:
            raise SystemExit(f"engine_bench: HF generate stopped early ({out.shape[1] - width} of {new} tokens)")
        for row, i in enumerate(idx):
            outputs[i] = out[row, width : width + workload[i][1]].tolist()
        computed += len(idx) * new
    return computed


class Timed:
    """Wall seconds, process CPU seconds and involuntary context switches of a block, accumulated."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.ivcsw = 0

    def __enter__(self) -> Timed:
        self._t = (time.perf_counter(), time.process_time(), ivcsw())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall += time.perf_counter() - self._t[0]
        self.cpu += time.process_time() - self._t[1]
        self.ivcsw += ivcsw() - self._t[2]


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    log(
        f"== 1. Throughput: {args.num_requests} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]}, "
        f"outputs {args.output_range[0]}-{args.output_range[1]} tokens, greedy, EOS ignored =="
    )
    workload = make_workload(args.num_requests, args.seed, args.prompt_range, args.output_range)
    useful = sum(n for _, n in workload)
    log(f"  workload: {sum(len(p) for p, _ in workload)} prompt tokens, {useful} requested output tokens")

    engine = new_engine(args, kv_cache_memory_gb=args.kv_gb)
    log(
        f"  pdserve: block_size {engine.config.block_size}, {engine.block_manager.num_blocks} KV blocks, "
        f"max_num_batched_tokens {engine.config.max_num_batched_tokens}, max_num_seqs {engine.config.max_num_seqs}, "
        f"chunked prefill {engine.config.enable_chunked_prefill}, torch threads {torch.get_num_threads()}"
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

    # Correctness gate: the two models must agree before timing means anything.
    check = make_workload(1, args.seed + 1000, (96, 96), (1, 1))[0][0]
    ours = engine_prompt_logits(engine, check)
    with torch.inference_mode():
        ref = hf(torch.tensor([check])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    argmax_agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    log(
        f"  logit check ({len(check)}-token prompt): max |pdserve - HF| = {diff:.2e}, "
        f"argmax agrees at {100 * argmax_agree:.0f}% of positions"
    )

    torch.set_num_threads(args.threads)
    warm_engine(engine)
    with torch.inference_mode():
        hf.generate(
            input_ids=torch.tensor([[5] * 32]),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN,
        )

    # HF runs in two halves (alternate batches) on either side of pdserve, so a change in the machine's
    # load during the run weighs on both sides rather than on whichever ran second.
    batches = hf_batches(workload, args.hf_batch)
    halves = (batches[0::2], batches[1::2])
    hf_out: list[list[int]] = [[] for _ in workload]
    hf_t, hf_computed = Timed(), 0
    log(
        f"  HF generate, first half: batches {', '.join(str(1 + batches.index(b)) for b in halves[0])} of "
        f"{len(batches)} (batches of {args.hf_batch} sorted by prompt length) ... ({load()})"
    )
    with hf_t:
        hf_computed += hf_generate_batched(hf, workload, halves[0], hf_out)
    log(f"    {hf_t.wall:.2f} s ({load()})")

    split = instrument(engine)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in workload]
    log(f"  pdserve generate, all {len(workload)} requests at once ... ({load()})")
    with Timed() as ours_t:
        completions = engine.generate([p for p, _ in workload], params)
    split.unwrap()
    ours_s, ours_cpu, ours_ivcsw = ours_t.wall, ours_t.cpu, ours_t.ivcsw
    got = [len(c.token_ids) for c in completions]
    if got != [n for _, n in workload]:
        raise SystemExit("engine_bench: pdserve returned a different number of tokens than requested")
    steps = list(engine.step_history)
    d = step_split(engine, split, steps)
    log(
        f"    {ours_s:.2f} s wall ({ours_cpu:.1f} s CPU), {useful / ours_s:.1f} output tok/s, {len(steps)} steps, "
        f"{sum(s.num_preempted for s in steps)} preemptions, {ours_ivcsw} involuntary context switches ({load()})"
    )

    first_half = hf_t.wall
    log(f"  HF generate, second half: the other {len(halves[1])} batches ... ({load()})")
    with hf_t:
        hf_computed += hf_generate_batched(hf, workload, halves[1], hf_out)
    hf_s, hf_cpu, hf_ivcsw = hf_t.wall, hf_t.cpu, hf_t.ivcsw
    log(f"    {hf_s - first_half:.2f} s ({load()})")
    hf_waste = {"generated_tokens_incl_waste": hf_computed}
    log(
        f"  HF total: {hf_s:.2f} s wall ({hf_cpu:.1f} s CPU), {useful / hf_s:.1f} useful output tok/s "
        f"({hf_computed / hf_s:.1f} tok/s counting padding-to-batch-max), "
        f"{hf_ivcsw} involuntary context switches"
    )

    speedup = hf_s / ours_s
    same = sum(1 for c, h in zip(completions, hf_out, strict=True) if c.token_ids == h)
    prefix = []
    for c, h in zip(completions, hf_out, strict=True):
        k = 0
        while k < len(h) and c.token_ids[k] == h[k]:
            k += 1
        prefix.append(k / len(h))
    log(
        f"  greedy outputs identical for {same}/{len(workload)} requests; mean agreeing prefix "
        f"{100 * statistics.mean(prefix):.1f}% (float32 ties may diverge: informational)"
    )
    log(
        f"  speedup pdserve / HF = {speedup:.2f}x wall (target >= {TARGET_SPEEDUP}x); "
        f"{hf_cpu / ours_cpu:.2f}x in process CPU time"
    )

    prefill_steps = [s for s in steps if s.num_prefill_tokens > 0]
    decode_steps = [s for s in steps if s.num_prefill_tokens == 0]
    log("  pdserve time split:")
    print_split(d)
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
    return {
        "num_requests": len(workload),
        "prompt_tokens": sum(len(p) for p, _ in workload),
        "output_tokens": useful,
        "logit_max_abs_diff": diff,
        "logit_argmax_agreement": argmax_agree,
        "pdserve_s": ours_s,
        "pdserve_cpu_s": ours_cpu,
        "pdserve_tok_s": useful / ours_s,
        "hf_s": hf_s,
        "hf_first_half_s": first_half,
        "hf_cpu_s": hf_cpu,
        "cpu_speedup": hf_cpu / ours_cpu,
        "hf_tok_s": useful / hf_s,
        "hf_batch": args.hf_batch,
        "hf_tokens_incl_padding": hf_waste["generated_tokens_incl_waste"],
        "speedup": speedup,
        "identical_outputs": same,
        "mean_agreeing_prefix": statistics.mean(prefix),
        "pdserve_split": d,
        "pdserve_steps": len(steps),
        "pdserve_prefill_steps": len(prefill_steps),
        "pdserve_prefill_step_s": sum(s.duration_s for s in prefill_steps),
        "pdserve_decode_step_s": sum(s.duration_s for s in decode_steps),
        "preemptions": sum(s.num_preempted for s in steps),
        "kv_cache_memory_gb": args.kv_gb,
        "hf": hf_info,
        "pdserve_involuntary_ctx_switches": ours_ivcsw,
        "hf_involuntary_ctx_switches": hf_ivcsw,
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
    rng = random.Random(args.seed * 1000 + 7 + trial)  # fresh prompts per trial: no prefix-cache hits
    stream_params = SamplingParams(max_tokens=engine.config.max_model_len - 128, temperature=0.0, ignore_eos=True)
    streams = [
        engine.add_request(
            [rng.randrange(256) for _ in range(rng.randint(32, 64))], stream_params, request_id=f"stream-{trial}-{i}"
        )
        for i in range(args.streams)
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
    long_prompt = [rng.randrange(256) for _ in range(args.long_prompt)]
    first_step = len(engine.step_history)
    long_id = f"long-{trial}"
    t_arrive = time.perf_counter()
    engine.add_request(long_prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id=long_id)
    t_first = None
    while t_first is None:
        for o in step():
            if o.request_id == long_id and o.new_token_ids:
                t_first = time.perf_counter()
    window = list(engine.step_history)[first_step:]
    for _ in range(args.tail_steps):
        step()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)

    during, before, after = [], [], []
    for ts in stamps.values():
        for a, b in itertools.pairwise(ts):
            if t_arrive < b < t_first:  # the token came while the long prompt was prefilling
                during.append(b - a)  # (decode tokens of the step that ends the prefill are stamped
            elif b >= t_first:  # before t_first, so they count as during)
                after.append(b - a)  # the long request now decodes alongside the streams
            elif a >= ts[min(2, len(ts) - 1)]:  # steady decode before it arrived
                before.append(b - a)
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
    workload = make_workload(n, args.seed + 3, args.sched_prompt_range, (1, 1))
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
    med_sched = statistics.median(st.schedule_s for st in steps)
    log(
        f"  step time median {ms(statistics.median(host))}, schedule() median {ms(med_sched)}"
        f" (p90 {ms(pct([st.schedule_s for st in steps], 0.9))}); share of step: median {100 * med_share:.2f}%, "
        f"p90 {100 * pct(shares, 0.9):.2f}% (target <= {100 * TARGET_SCHED_SHARE:.0f}%)"
    )
    log(f"  host-side work outside model forward + lm_head: {100 * non_model:.1f}% of step time; split:")
    print_split(d)
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return {
        "running": n,
        "steps": len(steps),
        "median_share": med_share,
        "p90_share": pct(shares, 0.9),
        "median_schedule_s": med_sched,
        "median_step_s": statistics.median(host),
        "non_model_share": non_model,
        "split": d,
    }


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
    events = {e.key: e for e in prof.key_averages()}
    total = sum(e.self_cpu_time_total for e in events.values())

    def inclusive(*names: str) -> float:
        return sum(events[n].cpu_time_total for n in names if n in events)

    def self_time(*names: str) -> float:
        return sum(events[n].self_cpu_time_total for n in names if n in events)

    groups = {  # shares of all op time; SDPA inclusive of the ops it runs, the others self time
        "scaled_dot_product_attention (inclusive)": inclusive("aten::scaled_dot_product_attention"),
        "linear layers (aten::mm/addmm)": self_time("aten::mm", "aten::addmm"),
        "KV gather (aten::index/index_select)": self_time("aten::index", "aten::index_select"),
        "KV write / scatter (aten::_index_put_impl_)": self_time("aten::_index_put_impl_"),
    }
    shares = {}
    for name, t in groups.items():
        shares[name] = t / total
        log(f"  {name:<44} {100 * t / total:5.1f}% of op time")
    math = events.get("aten::_scaled_dot_product_attention_math")
    if math is not None:
        log(
            f"  NOTE: {math.count} SDPA calls ran the unfused math kernel (aten::_scaled_dot_product_attention_math,"
            f" {100 * math.cpu_time_total / total:.1f}% of op time): on CPU the flash kernel needs 4-D inputs"
        )
    shares["sdpa_math_calls"] = math.count if math is not None else 0
    log(
        f"  step times: {', '.join(ms(st.duration_s) for st in steps)} (under the profiler), "
        f"{steps[0].num_seqs} seqs, context {min(r.num_tokens for r in s.running)}-"
        f"{max(r.num_tokens for r in s.running)} tokens"
    )
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
    sections = args.only or ["throughput", "interference", "scheduler"]

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
        rows.append(
            (
                "logits vs HF, max |diff|",
                f"{t['logit_max_abs_diff']:.1e}",
                f"<= {TARGET_LOGIT_DIFF:.0e}",
                verdict(t["logit_max_abs_diff"] <= TARGET_LOGIT_DIFF),
            )
        )
        rows.append(
            (
                f"throughput pdserve / HF ({t['pdserve_tok_s']:.0f} vs {t['hf_tok_s']:.0f} tok/s)",
                f"{t['speedup']:.2f}x",
                f">= {TARGET_SPEEDUP}x",
                verdict(t["speedup"] >= TARGET_SPEEDUP),
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
