"""Decode speed of the offline engine on a GGUF model, against the weight-bytes / bandwidth floor.

For each variant, in its own process (fresh memory, the same torch threads), interleaved over the
repetitions so that load from other processes falls on every variant alike:

- one stream: a chat prompt, ``--tokens`` greedy tokens (EOS ignored); decode tok/s over the steps after the
  first token;
- 16 streams: 16 chat prompts at once, ``--tokens`` each; output tok/s over the whole ``generate``;
- the weight bytes one decode step streams (every parameter and buffer of the model, shared ones once),
  and the resident memory of the process after the runs.

The floor of a small-batch decode step is weight bytes / memory bandwidth; the bandwidth is measured here
with a torch copy of 512 MiB (bytes read + written per second). ``--before REF`` adds the engine of a git
revision (exported to a temporary directory) as the variant ``before`` (with the options of
``--before-variant``, its defaults unless given), ``--after REF`` runs the others on a
revision instead of the working tree; ``--profile`` prints torch.profiler's top entries for 16-stream decode
steps of each variant.

``--conditions`` says how each variant runs: ``offline`` (the default) steps the engine on the process's main
thread under ``OMP_WAIT_POLICY=PASSIVE``, so a step of a few tokens runs on one thread; ``worker`` runs it as an
engine worker does: built by ``build_in_passing_thread``, warmed up and stepped on an ``EngineLoop``'s thread,
with the workers' ``GOMP_SPINCOUNT`` (OpenMP threads spin between kernels, so small steps use every thread).
Both, comma-separated, run side by side.

    python benchmarks/decode_speed.py [--model smollm2] [--variants none,native]
        [--before REF [--before-variant float16]] [--after REF] [--tokens 128] [--conditions offline,worker]
        [--repeat 2] [--threads 2] [--profile]
    python benchmarks/decode_speed.py --kernels [--model smollm2] [--kernel-batches 1,16]   # the GEMM kernels alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# OpenMP threads that spin at barriers stall on a shared machine (see engine_bench); a run in a worker's
# conditions gets the workers' spin count instead
if __name__ == "__main__" and "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is the largest ocean on Earth?",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "What is two plus two?",
]
WEIGHT_FORMATS = {"none": "dequantised", "native": "int4/int8", "float16": "float16"}
CONDITIONS = ("offline", "worker")  # how a variant's engine runs (``--conditions``)
VARIANTS: dict[str, dict[str, Any]] = {  # name -> EngineConfig overrides
    "none": {"quantization": "none"},
    "none-kv-bf16": {"quantization": "none", "kv_cache_dtype": "bfloat16"},
    "native": {"quantization": "native"},
    "native-bf16": {"quantization": "native", "dtype": "bfloat16"},
    "float16": {"quantization": "float16"},
    "auto": {},  # what --quantization auto picks on this machine
    "before": {},
}


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second a torch copy moves (read + write), best of ``repeats``."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def kernel_times(
    model: str, threads: int, repeats: int = 5, batches: tuple[int, ...] = (1, 16)
) -> dict[str, dict[int, float]]:
    """Seconds for every linear layer of ``model`` (random weights of its shapes) once, per GEMM and batch size:
    float32 dense (``F.linear``, and the engine's ``Linear``, which runs a few rows as a two-batch product) and
    bfloat16 dense, int4 weight-only (float32 and bfloat16 activations), int8 weight-only, and float16 weights
    computed in float32 (``--quantization float16``'s ``Float16Linear``: FBGEMM's float16 GEMM where torch has
    it, and the path it takes elsewhere, float16 matrix-vector products and float32 tiles)."""
    import torch

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model import Linear
    from pdserve.engine.quantization import Float16Linear, TileScratch

    torch.set_num_threads(threads)
    c = ModelConfig.load(model)
    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = [(q_rows, c.hidden_size), (kv_rows, c.hidden_size), (kv_rows, c.hidden_size)]
    per_layer += [(c.hidden_size, q_rows), (c.intermediate_size, c.hidden_size)] * 1
    per_layer += [(c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    shapes = per_layer * c.num_hidden_layers
    dense = [torch.randn(n, k) for n, k in shapes]
    dense_bf16 = [w.bfloat16() for w in dense]
    int4 = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        for n, k in shapes
    ]
    sz = [torch.rand(k // 32, n, 2) for n, k in shapes]
    sz_bf16 = [t.bfloat16() for t in sz]
    int8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n, k in shapes]
    scales_bf16 = [torch.rand(n).bfloat16() for n, _ in shapes]
    scratch = TileScratch()
    half = [Float16Linear(w, None, scratch) for w in dense]  # FBGEMM's float16 GEMM where torch has it
    half_tiles = [Float16Linear(w, None, scratch, use_fbgemm=False) for w in dense]
    engine_linear = []
    for w in dense:
        layer = Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        engine_linear.append(layer)

    mm4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    mm8 = torch.ops.aten._weight_int8pack_mm
    linear = torch.nn.functional.linear

    def one_pass(kind: str, x: dict[int, torch.Tensor], xb: dict[int, torch.Tensor]) -> None:
        for i, (_, k) in enumerate(shapes):
            if kind == "float32 dense":
                linear(x[k], dense[i])
            elif kind == "float32 dense, the engine's Linear":
                engine_linear[i](x[k])
            elif kind == "bfloat16 dense":
                linear(xb[k], dense_bf16[i])
            elif kind == "int4, float32 activations":
                mm4(x[k], int4[i], 32, sz[i])
            elif kind == "int4, bfloat16 activations":
                mm4(xb[k], int4[i], 32, sz_bf16[i])
            elif kind == "float16 weights, float32 activations":
                half[i](x[k])
            elif kind == "float16 weights, matrix-vector / float32 tiles":
                half_tiles[i](x[k])
            else:
                mm8(xb[k], int8[i], scales_bf16[i])

    kinds = (
        "float32 dense",
        "float32 dense, the engine's Linear",
        "bfloat16 dense",
        "int4, float32 activations",
        "int4, bfloat16 activations",
        "int8",
        "float16 weights, float32 activations",
        "float16 weights, matrix-vector / float32 tiles",
    )
    out: dict[str, dict[int, float]] = {}
    for m in batches:
        x = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
        xb = {k: v.bfloat16() for k, v in x.items()}
        for kind in kinds:
            one_pass(kind, x, xb)
            start = time.perf_counter()
            for _ in range(repeats):
                one_pass(kind, x, xb)
            name = "int8, bfloat16 activations" if kind == "int8" else kind
            out.setdefault(name, {})[m] = (time.perf_counter() - start) / repeats
    return out


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's measurements (runs in the variant's own process)."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine
    from pdserve.engine.engine_loop import EngineLoop, build_in_passing_thread

    overrides = json.loads(args.overrides)
    if args.conditions != "worker":
        torch.set_num_threads(args.threads)
        return measure(LLMEngine(EngineConfig(model=args.model, device="cpu", max_num_seqs=64, **overrides)), args)
    # as a worker: the engine sets its thread count while it is built, as a worker's does
    overrides.setdefault("torch_threads", args.threads)
    config = EngineConfig(model=args.model, device="cpu", max_num_seqs=64, **overrides)
    loop = EngineLoop(build_in_passing_thread(lambda: LLMEngine(config)))
    try:  # every step, the warm-up's too, on the loop's thread: its OpenMP team is the process's only one
        return loop.call(lambda engine: measure(engine, args)).result()
    finally:
        loop.stop()


def measure(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one engine, on the calling thread."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.quantization import weight_bytes as model_weight_bytes

    model = engine.runner.model
    weight_bytes = model_weight_bytes(model)
    if getattr(model.model.embed_tokens, "weight", None) is not None and not model.config.tie_word_embeddings:
        weight_bytes -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    weight_bytes -= model.model.rotary_emb.cos.numel() * 4 * 2  # tables read a row per token, not streamed
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise SystemExit(f"model {args.model!r} has no tokenizer: use a GGUF file or a checkpoint preset")
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    engine.generate(chat[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm up

    engine.add_request(chat[0], params)
    first: float | None = None
    first_cpu = 0.0
    done = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        done += sum(len(o.new_token_ids) for o in outputs)
        if first is None and done:
            first, first_cpu = time.perf_counter(), time.process_time()
    assert first is not None
    one_stream = (done - 1) / (time.perf_counter() - first)
    one_stream_cpu = (done - 1) / (time.process_time() - first_cpu)  # per CPU-second: less load-sensitive

    prompts = [chat[i % len(chat)] for i in range(16)]
    sixteen = float("nan")
    if not args.one_stream_only:
        start = time.perf_counter()
        completions = engine.generate(prompts, params)
        sixteen = sum(len(c.token_ids) for c in completions) / (time.perf_counter() - start)

    profile: list[str] = []
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        started: set[str] = set()
        for p in prompts:
            engine.add_request(p, params)
        while len(started) < len(prompts):  # every prompt prefilled: the steps from here on are decodes
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(min(8, args.tokens // 2)):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
        profile = table.splitlines()
        for r in list(engine.scheduler.running):
            engine.abort(r.request_id)
    return {
        "one_stream_tok_s": one_stream,
        "one_stream_tok_cpu_s": one_stream_cpu,
        "sixteen_streams_tok_s": sixteen,
        "weight_bytes": weight_bytes,
        "rss_bytes": rss_bytes(),
        "kv_bytes_per_token": engine.kv_cache[0].numel() * engine.kv_cache.element_size() // engine.config.block_size,
        "compute_dtype": str(engine.dtype).removeprefix("torch."),
        "quantized": getattr(engine, "quantized", False),
        "quantization": getattr(engine, "quantization", "native" if getattr(engine, "quantized", False) else "none"),
        "profile": profile,
        "stepping_thread": threading.current_thread().name,  # the conditions it ran in, as the engine saw them
        "threads_spin": engine.threads_spin,
    }


def export_revision(ref: str) -> str:
    """``ref``'s tree in a temporary directory (git archive), for the ``before`` variant."""
    root = tempfile.mkdtemp(prefix="pdserve-before-")
    archive = subprocess.run(["git", "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    return root


def run_variant(args: argparse.Namespace, name: str, source_root: str, conditions: str) -> dict[str, Any]:
    from pdserve.deployment_config import DEFAULT_OMP_SPIN_COUNT
    from pdserve.priority import OMP_SPIN_COUNT_ENV

    overrides = VARIANTS[name] if name != "before" else VARIANTS[args.before_variant]
    command = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--model",
            args.model,
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
            "--overrides",
            json.dumps(overrides),
            "--profile-rows",
            str(args.profile_rows),
        ]
        + (["--conditions", conditions] if conditions != "offline" else [])  # a --before revision may predate it
        + (["--profile"] if args.profile else [])
        + (["--one-stream-only"] if args.one_stream_only else [])
    )
    env = {**os.environ, "PYTHONPATH": source_root}
    env.pop("OMP_WAIT_POLICY", None)
    env.pop(OMP_SPIN_COUNT_ENV, None)
    if conditions == "worker":
        env[OMP_SPIN_COUNT_ENV] = str(DEFAULT_OMP_SPIN_COUNT)
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=source_root)
    if result.returncode != 0:
        raise RuntimeError(f"variant {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--variants", default="none,none-kv-bf16", help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--before", metavar="REF", help="also run the engine of this git revision ('before')")
    parser.add_argument(
        "--before-variant", default="auto", help="the variant's options for 'before' (default: its own defaults)"
    )
    parser.add_argument("--after", metavar="REF", help="run the other variants on this git revision, not the tree")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--one-stream-only", action="store_true", help="skip the 16-stream run")
    parser.add_argument("--profile-rows", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--kernels", action="store_true", help="only time the GEMM kernels over the model's shapes")
    parser.add_argument("--kernel-batches", default="1,16", help="--kernels: the batch sizes (rows), comma-separated")
    parser.add_argument(
        "--conditions",
        default="offline",
        help="offline (main thread, PASSIVE OpenMP threads), worker (as an engine worker steps), or offline,worker",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    if args.kernels:
        try:
            batches = tuple(int(b) for b in args.kernel_batches.split(","))
        except ValueError:
            batches = ()
        if not batches or min(batches) < 1:
            parser.error(f"--kernel-batches: positive integers, comma-separated, not {args.kernel_batches!r}")
        times = kernel_times(args.model, args.threads, batches=batches)
        print(f"every linear layer of {args.model} once (random weights), {args.threads} threads; ms")
        print("| GEMM | " + " | ".join(f"batch {b}" for b in batches) + " |")
        print("|---|" + "---:|" * len(batches))
        for name, by_batch in times.items():
            print(f"| {name} | " + " | ".join(f"{1000 * by_batch[b]:.1f}" for b in batches) + " |")
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS or n == "before"]
    if args.before_variant == "before" or args.before_variant not in VARIANTS:
        unknown.append(args.before_variant)
    if unknown:
        parser.error(f"unknown variants: {', '.join(unknown)}")
    conditions = [c for c in args.conditions.split(",") if c]
    if not conditions or any(c not in CONDITIONS for c in conditions):
        parser.error(f"--conditions: {' or '.join(CONDITIONS)}, comma-separated, not {args.conditions!r}")
    after_root = export_revision(args.after) if args.after else here
    roots = {n: after_root for n in names}
    if args.before:
        names.insert(0, "before")
        roots["before"] = export_revision(args.before)
    runs = [(name, c) for name in names for c in conditions]
    bandwidth = measure_bandwidth()
    print(f"memory bandwidth (torch copy, read + write): {bandwidth / 1e9:.1f} GB/s; threads {args.threads}")
    labels = {run: run[0] if len(conditions) == 1 else f"{run[0]} ({run[1]})" for run in runs}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {run: [] for run in runs}
    for rep in range(args.repeat):
        for name, c in runs:
            results[name, c].append(run_variant(args, name, roots[name], c))
            r = results[name, c][-1]
            print(
                f"  rep {rep} {labels[name, c]}: 1 stream {r['one_stream_tok_s']:.1f} tok/s, "
                f"16 streams {r['sixteen_streams_tok_s']:.1f} tok/s",
                flush=True,
            )
    print()
    header = "| variant | weights | compute | weights MB | KV KiB/token | 1 stream tok/s | tok/CPU-s | step ms | "
    print(header + "floor ms | step / floor | 16 streams tok/s | RSS MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        done = results[run]
        one = [r["one_stream_tok_s"] for r in done]
        one_cpu = [r.get("one_stream_tok_cpu_s", float("nan")) for r in done]
        sixteen = [r["sixteen_streams_tok_s"] for r in done]
        last = done[-1]
        step_ms = 1000 / statistics.median(one)
        floor_ms = 1000 * last["weight_bytes"] / bandwidth
        print(
            f"| {labels[run]} | {WEIGHT_FORMATS.get(last.get('quantization', 'none'), '?')} | {last['compute_dtype']} "
            f"| {last['weight_bytes'] / 1e6:.0f} | {last['kv_bytes_per_token'] / 1024:.0f} "
            f"| {statistics.median(one):.1f} ({min(one):.1f}-{max(one):.1f}) | {statistics.median(one_cpu):.1f} "
            f"| {step_ms:.1f} | {floor_ms:.1f} "
            f"| {step_ms / floor_ms:.1f}x | {statistics.median(sixteen):.1f} ({min(sixteen):.1f}-{max(sixteen):.1f}) "
            f"| {last['rss_bytes'] / 1e6:.0f} |"
        )
    if args.profile:
        for run in runs:
            print(f"\nprofile, 16-stream decode steps, {labels[run]}:")
            print("\n".join(results[run][-1]["profile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
