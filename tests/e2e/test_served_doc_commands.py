"""The commands README.md and docs/ show with their output against a deployment, run as written (only the ports
differ: free ones instead of 50051, 8000 and 8088) and compared with what the pages show: the README's tour, step
1, on its own deployment of SmolLM2, then the serving pages' gRPC and HTTP commands on it; and the engine page's
offline generation, too slow for the quick loop."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.doc_blocks import REPO, block, console, shape

pytestmark = pytest.mark.cluster

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]
RAY_WORKER_LINE = re.compile(r"^(\x1b\[\d+m)?\(\w+ pid=\d+")  # a line Ray forwards from a worker's log
BIN = Path(sys.executable).parent  # grpcurl comes with the test extras, beside this interpreter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, server: subprocess.Popen[str], printed: str, ports: dict[str, str]) -> None:
        self.server, self.printed, self.ports = server, printed, ports

    def local(self, text: str) -> str:
        """``text`` with the documented ports replaced by this deployment's."""
        for documented, port in self.ports.items():
            text = text.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{port}")
        return text

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        """A documented command line (``pdserve``, ``curl`` or ``grpcurl``) against this deployment."""
        argv = shlex.split(self.local(command.split("  #", 1)[0]))
        if argv[0] == "pdserve":
            argv = [*PDSERVE, *argv[1:]]
            if argv[len(PDSERVE)] in ("generate", "status") and "--target" not in argv:
                argv += ["--target", f"127.0.0.1:{self.ports['50051']}"]
        elif argv[0] == "grpcurl":
            argv[0] = str(BIN / "grpcurl")
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The README's deployment (its command, with free ports)."""
    tour = block("README.md", "pdserve serve --model smollm2")
    ports = {"50051": str(free_port()), "8000": str(free_port()), "8088": str(free_port())}
    argv = shlex.split(tour.command.strip())[1:] + ["--port", ports["50051"]]
    argv[argv.index("--http-port") + 1], argv[argv.index("--explorer-port") + 1] = ports["8000"], ports["8088"]
    server = subprocess.Popen([*PDSERVE, *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              cwd=REPO, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("explorer (playground") for line in lines):
            assert server.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(server.stdout.readline())  # type: ignore[union-attr]
        yield Served(server, "".join(lines), ports)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def answer_lines(text: str) -> list[str]:
    return [line for line in text.strip().splitlines() if line.strip()]


def fields(text: str) -> list[str]:
    """The names of a metadata block's ``name: value`` lines."""
    return [m.group(1) for m in re.finditer(r"^([a-zA-Z][\w ]*?):\s{2,}", text, re.M)]


def test_the_readme_tour(served: Served):
    """README, step 1: the start-up lines; the gRPC answer and its metadata; curl; the openai client; status."""
    tour = block("README.md", "pdserve serve --model smollm2")
    printed = [line for line in served.printed.strip().splitlines() if not RAY_WORKER_LINE.match(line)]
    assert printed == served.local(tour.output).strip().splitlines()  # Ray's lines from the workers' logs aside

    generate = block("README.md", "pdserve generate --mode disaggregated")
    result = served.run(generate.command.strip())
    assert result.returncode == 0, result.stderr
    shown_answer, shown_meta = generate.output.split("finish reason:", 1)
    assert answer_lines(result.stdout) == answer_lines(shown_answer)
    got = fields(result.stderr)
    assert [f for f in fields("finish reason:       x\n" + shown_meta) if f in got] == fields(
        "finish reason:       x\n" + shown_meta
    ), result.stderr  # every line shown is printed (the page leaves some out)
    assert "mode:                disaggregated" in result.stderr

    chat = block("README.md", "curl -s 127.0.0.1:8000/v1/chat/completions")
    check_chat_answer(served, chat.command, chat.output)

    client = block("README.md", "from openai import OpenAI")
    snippet = served.local(client.command).replace("127.0.0.1:8000", f"127.0.0.1:{served.ports['8000']}")
    printed = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    text, metrics = printed.stdout.strip().rsplit("\n", 1)
    assert text.strip() and "'mode': 'disaggregated'" in metrics and "'prefill_worker': 'prefill-0'" in metrics

    status = served.run("pdserve status")
    assert status.returncode == 0, status.stderr
    shown = re.search(r"`pdserve status` prints[^\n]*\n\n```\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert shown is not None
    page, out = shown.group(1).splitlines(), status.stdout.splitlines()
    assert out[0] == page[0] and [row.split()[:2] for row in out[1:]] == [row.split()[:2] for row in page[1:]]


def check_chat_answer(served: Served, command: str, shown: str) -> None:
    """A chat completion's answer as a page shows it (wrapped JSON with ``…`` for what varies): its text,
    finish reason and usage."""
    result = served.run(" ".join(command.replace("\\\n", " ").split()))
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    flat = " ".join(shown.split()).replace('"content":" ', '"content":"')  # the page wraps its lines anywhere
    packed = "".join(shown.split())
    content = answer["choices"][0]["message"]["content"]
    assert f'"content":"{content}"' in flat, (content, flat)
    assert f'"finish_reason":"{answer["choices"][0]["finish_reason"]}"' in packed
    assert json.dumps(answer["usage"], separators=(",", ":")) in packed


def test_the_chat_completion_as_written(served: Served):
    page = block("docs/serving.md", "curl -s 127.0.0.1:8000/v1/chat/completions")
    check_chat_answer(served, page.command, page.output)


def test_tokenize_and_detokenize_as_written(served: Served):
    page = block("docs/serving.md", "curl -s 127.0.0.1:8000/tokenize")
    for command, output in console(page.command):
        result = served.run(command)
        assert result.returncode == 0 and result.stdout.strip() == output.strip(), (command, result.stdout)


def test_grpcurl_as_written(served: Served):
    """Reflection, a Generate call and the health check, as grpcurl shows them (the stream cut after its first
    message on the page)."""
    page = block("docs/serving.md", "grpcurl -plaintext 127.0.0.1:50051 list")
    for command, output in console(page.command):
        result = served.run(command.replace("127.0.0.1:50051", f"127.0.0.1:{served.ports['50051']}"))
        assert result.returncode == 0, (command, result.stderr)
        shown = output.strip()
        if shown.endswith("..."):
            first = json.loads(result.stdout[: result.stdout.index("}") + 1])
            assert first == json.loads(shown[: -len("...")]), (command, result.stdout)
        else:
            assert shape(result.stdout) == shape(shown), (command, result.stdout)


def test_offline_generate():
    """The engine page: the answer on stdout, the summary on stderr (no deployment; SmolLM2 loads in about 30 s
    on a 2-core VM, too long for the quick loop)."""
    page = block("docs/engine.md", "pdserve generate --offline")
    argv = [*PDSERVE, *shlex.split(page.command.strip())[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).strip() == page.output.strip()
