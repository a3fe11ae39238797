"""The `pdserve` command: offline generation, and `serve` + `generate` as separate processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_generate_offline_streams_text_and_reports():
    result = _run("generate", "--offline", "Hello", "--max-tokens", "8", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "finish_reason=length steps=8 model=tiny" in result.stderr


def test_bad_arguments_get_a_clear_error():
    result = _run("generate", "--offline", "x", "--top-p", "2")
    assert result.returncode == 2 and "top_p must be in (0, 1]" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cluster
def test_serve_then_generate_then_ctrl_c_stops_cleanly():
    port = _free_port()
    server = subprocess.Popen(
        [
            *PDSERVE,
            "serve",
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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "listening on" not in line:
            assert time.monotonic() < deadline and server.poll() is None, "server did not start"
            line = server.stdout.readline()
        assert f"127.0.0.1:{port}" in line and "mode=auto" in line
        for mode in ("colocated", "disaggregated"):
            result = _run(
                "generate",
                "a prompt of some length",
                "--target",
                f"127.0.0.1:{port}",
                "--mode",
                mode,
                "--max-tokens",
                "5",
                "--ignore-eos",
            )
            assert result.returncode == 0, result.stderr
            assert f"'mode': '{mode}'" in result.stderr and "'num_output_tokens': 5" in result.stderr
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=60)
        assert server.returncode == 0 and "stopping" in output
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
