"""benchmarks/decode_speed.py's conditions: a variant measured offline steps on the process's main thread with
OpenMP threads that sleep at once; measured as a worker, on an engine loop's thread with the workers' spin
count. Each runs for real (the smollm2 GGUF file, a few tokens), in its own process as the benchmark runs it."""

from __future__ import annotations

import argparse
import os

import decode_speed
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_args(**overrides: object) -> argparse.Namespace:
    args = dict(
        model="smollm2",
        tokens=4,
        threads=2,
        profile=False,
        one_stream_only=True,
        profile_rows=5,
        timeout=600.0,
        before_variant="auto",
    )
    return argparse.Namespace(**{**args, **overrides})


@pytest.mark.parametrize(
    ("conditions", "thread", "spin"), [("offline", "MainThread", False), ("worker", "engine-loop", True)]
)
def test_a_variant_runs_in_the_conditions_asked_for(conditions, thread, spin):
    result = decode_speed.run_variant(bench_args(), "native", ROOT, conditions)
    assert result["stepping_thread"] == thread and result["threads_spin"] is spin
    assert result["one_stream_tok_s"] > 0 and result["quantization"] == "native"


def test_unknown_conditions_are_refused(capsys):
    with pytest.raises(SystemExit):
        decode_speed.main(["--variants", "native", "--conditions", "offline,served"])
    assert "--conditions: offline or worker" in capsys.readouterr().err
