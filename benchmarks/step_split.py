"""Where an engine step's time goes, measured in process: wrappers that time the engine's parts.

``instrument(engine)`` redirects attribute lookups of the engine's runner, model layers and
``scaled_dot_product_attention`` to timed wrappers (nothing in ``engine/`` changes; ``unwrap`` undoes
it); ``step_split`` turns the seconds into a breakdown of the given steps and ``print_split`` prints it.
``Timed`` accumulates wall time, process CPU time and involuntary context switches of a block.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

# Optional, engine-version-specific methods of each layer's Attention: timed when they exist.
ATTENTION_PARTS = (
    ("_decode_attention", "decode attention"),
    ("_prefill_attention", "prefill attention"),
    ("_context", "KV gather (Attention._context)"),
)


def ivcsw() -> int:
    """Involuntary context switches of this process so far: a sign of other load on the machine."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    except (ImportError, OSError):
        return 0


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


def instrument(engine: Any) -> Split:
    """Time the parts of an ``LLMEngine``'s step. Only attribute lookups are redirected."""
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


def step_split(split: Split, steps: Sequence[Any]) -> dict[str, float]:
    """Where the time of ``steps`` (the engine's step records, timed by ``split``) went, in seconds."""
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
    """Print a ``step_split`` breakdown, one line per part with its share of the total."""
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
        print(f"{indent}{name:<48} {d[key]:8.2f} s  {100 * d[key] / total:5.1f}%", flush=True)
