"""The `pdserve` command: offline generation, and `serve` + `generate` as separate processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import psutil
import pytest

from pdserve.cli.output import format_metadata
from pdserve.messages import RequestMetrics

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_generate_offline_streams_text_and_reports():
    result = _run("generate", "--offline", "Hello", "--max-tokens", "8", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "finish reason: length",
        "steps:         8",
        "model:         tiny",
        "device:        cpu",
    ]


def test_version():
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"pdserve {version('pdserve')}"


@pytest.mark.parametrize(
    ("command", "scheme", "prefix"),
    [
        (["generate", "What is the capital of France?"], "", "error"),
        (["status"], "", "error"),
        (["bench", "--num-requests", "2"], "", "pdserve bench: error"),
        (["bench", "--num-requests", "2"], "http://", "pdserve bench: error"),
    ],
)
def test_an_unreachable_server_is_one_line_naming_it(command: list[str], scheme: str, prefix: str):
    target = f"{scheme}127.0.0.1:{_free_port()}"  # nothing listens on it
    result = _run(*command, "--target", target, timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"{prefix}: cannot reach {target}: "), result.stderr
    assert "UNAVAILABLE" in result.stderr or "Connection refused" in result.stderr, result.stderr


def test_metadata_prints_as_aligned_lines_with_units():
    meta = RequestMetrics(
        request_id="r1",
        mode="disaggregated",
        decode_worker="decode-0",
        prefill_worker="prefill-0",
        router="router-0",
        queue_s=0.0021,
        prefill_s=0.1503,
        kv_transfer_s=0.0125,
        kv_transfer_bytes=3 * 1024 * 1024,
        ttft_s=0.1774,
        e2e_s=1.25,
        num_prompt_tokens=12,
        num_output_tokens=5,
        num_cached_tokens=0,
    )
    lines = format_metadata(meta, "length").splitlines()
    assert lines[0] == "finish reason:       length"
    pairs = dict(line.split(": ", 1) for line in lines)
    assert {k: v.strip() for k, v in pairs.items()} == {
        "finish reason": "length",
        "request": "r1",
        "mode": "disaggregated",
        "router": "router-0",
        "prefill worker": "prefill-0",
        "decode worker": "decode-0",
        "prompt tokens": "12 tokens",
        "cached tokens": "0 tokens",
        "output tokens": "5 tokens",
        "time to first token": "177.4 ms",
        "queue": "2.1 ms",
        "prefill": "150.3 ms",
        "KV transfer": "12.5 ms",
        "KV transferred": "3.0 MiB",
        "end to end": "1250.0 ms",
    }
    assert len({len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}) == 1  # one value column
    local = format_metadata(meta._replace(prefill_worker="", kv_transfer_bytes=0, mode="colocated"), None)
    assert "KV" not in local and "prefill" not in local and "finish reason:       none" in local


def test_pd_search_reports_progress_on_stderr(tmp_path):
    argv = ["sim", "--pd-search", "2", "--slo", "ttft=500,tpot=100", "--no-rate-search", "--num-requests", "20"]
    result = _run(*argv, "--out", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("pd search [")]
    summary = re.search(r"pd search: (\d+) instance shapes and (\d+) deployments in \d+ s", result.stderr)
    assert summary is not None, result.stderr
    n = int(summary.group(2))  # the verified deployments: disaggregated, colocated and auto ones
    assert n >= 3 and int(summary.group(1)) >= 2
    # one line per deployment as its simulation ends (in any order when several run at once)
    assert sorted(line.split("]")[0] for line in progress) == sorted(f"pd search [{i}/{n}" for i in range(1, n + 1))
    names = [line.split("] ", 1)[1] for line in progress]
    assert any(name.startswith("colocated") for name in names) and any(":" in name for name in names), names
    assert "best per GPU" in result.stdout


def test_bad_arguments_get_a_clear_error():
    result = _run("generate", "--offline", "x", "--top-p", "2")
    assert result.returncode == 2 and "top_p must be in (0, 1]" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fields(text: str) -> dict[str, str]:
    """The ``key: value`` lines of a command's metadata."""
    return {key: value.strip() for key, value in (line.split(":", 1) for line in text.splitlines())}


@pytest.mark.cluster
def test_serve_then_generate_then_ctrl_c_stops_cleanly():
    """One deployment of the real chat model: start-up stages, a question answered through its chat
    template, both modes with their metadata, Ctrl-C."""
    port = _free_port()
    server = subprocess.Popen(
        [
            *PDSERVE,
            "serve",
            "--model",
            "smollm2",
            "--mode",
            "auto",
            "--transport",
            "grpc",
            "--port",
            str(port),
            "--num-kv-blocks",
            "256",
            "--auto-min-remote-tokens",
            "8",
            "--omp-spin-count",
            "4321",
            "--verify-kv",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        lines = [""]
        while "pdserve listening on" not in lines[-1]:
            assert time.monotonic() < deadline and server.poll() is None, "server did not start:\n" + "".join(lines)
            lines.append(server.stdout.readline())
        assert f"127.0.0.1:{port}" in lines[-1] and "mode=auto" in lines[-1]
        stages = "".join(lines)
        for stage in ("Ray started", "workers placed: decode-0, prefill-0", "model smollm2 loaded", "listening on"):
            assert stage in stages, stages
        target = ["--target", f"127.0.0.1:{port}"]
        answer = _run("generate", "What is the capital of France?", *target, "--max-tokens", "24")
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout, (answer.stdout, answer.stderr)
        assert _fields(answer.stderr)["finish reason"] == "stop", answer.stderr
        for mode in ("colocated", "disaggregated"):
            result = _run(
                "generate",
                "a prompt of some length",
                *target,
                "--raw",
                "--mode",
                mode,
                "--max-tokens",
                "5",
                "--ignore-eos",
            )
            assert result.returncode == 0, result.stderr
            meta = _fields(result.stderr)
            assert meta["mode"] == mode and meta["output tokens"] == "5 tokens", result.stderr
            assert meta["finish reason"] == "length" and meta["time to first token"].endswith(" ms")
        # the local cluster's engine workers start with the spin count asked for
        spin_counts = {}
        for process in psutil.Process(server.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(process.cmdline())
                for role in ("DecodeWorker", "PrefillWorker"):
                    if title.startswith(f"ray::{role}"):
                        spin_counts[role] = process.environ().get("GOMP_SPINCOUNT")
        assert spin_counts == {"DecodeWorker": "4321", "PrefillWorker": "4321"}
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=60)
        assert server.returncode == 0 and "stopping" in output
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def test_the_router_renders_the_user_turn_with_its_models_chat_template():
    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.router.server import user_turn_prompt

    question = "What is the capital of France?"
    smollm2 = load_tokenizer("smollm2")
    assert user_turn_prompt(smollm2, question) == smollm2.apply_chat_template([{"role": "user", "content": question}])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in user_turn_prompt(smollm2, question)
    assert user_turn_prompt(load_tokenizer("tiny"), question) == question  # no template: the text as is
    assert user_turn_prompt(None, question) == question
