"""The front doors' limits on real servers: shutdown with open streams, disconnects, body limits, TLS,
the queue-time bound, and the explorer's access rules, bursts and playground runs.

The ``pdserve serve`` test comes first: it starts Ray in a process of its own, before this module's
deployment starts one here.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from fastapi import FastAPI, Request
from support.checks import assert_no_leaks
from test_access import make_ca_and_server_cert

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.explorer.app import PlaygroundRefused, PlaygroundRunner
from pdserve.explorer.live import BurstBusy, Bursts, BurstSpec
from pdserve.explorer.playground import PlaygroundSettings, SettingError
from pdserve.net import HttpServer, server_tls_context
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.client import Client
from pdserve.router.config import RouterConfig
from pdserve.router.http_api import FrontDoor, _unless_disconnected
from pdserve.router.router import GenerateInput, ModelLimits, RequestError, Router, WorkerHandle

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "front-door-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(
    conn: http.client.HTTPConnection, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    raw = response.read()
    return response.status, json.loads(raw) if raw else None


def open_stream(conn: http.client.HTTPConnection, max_tokens: int = 900, headers: dict[str, str] | None = None):
    """A streamed completion, its first event read (the rest left unread)."""
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.readline().startswith(b"data: ")
    return response


# ---- pdserve serve stops on SIGINT ---------------------------------------------------------------------


@pytest.mark.cluster
def test_sigint_drains_serve_with_http_and_grpc_streams_and_the_explorer_open():
    """Ctrl-C with streams open: each HTTP stream ends with an error event then [DONE], a gRPC client reports
    "server shutting down" after ending its line, and the log has no traceback."""
    port, http_port, explorer_port = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        [
            *PDSERVE,
            "serve",
            "--transport",
            "grpc",
            "--port",
            str(port),
            "--http-port",
            str(http_port),
            "--explorer-port",
            str(explorer_port),
            "--num-kv-blocks",
            "256",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        # started as a shell's background job is: SIGINT ignored (Python then installs no handler of its own)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    connections: list[http.client.HTTPConnection] = []
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "explorer (playground" not in line:
            assert time.monotonic() < deadline and server.poll() is None, "server did not start"
            line = server.stdout.readline()
        connections = [http.client.HTTPConnection("127.0.0.1", http_port, timeout=60) for _ in range(2)]
        streams = [open_stream(conn, max_tokens=4000) for conn in connections]
        generate = subprocess.Popen(
            [*PDSERVE, "generate", "Hello", "--raw", "--target", f"127.0.0.1:{port}", "--max-tokens", "4000",
             "--ignore-eos"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert generate.stdout.read(1)  # its stream is open
        explorer = http.client.HTTPConnection("127.0.0.1", explorer_port, timeout=30)
        connections.append(explorer)
        explorer.request("GET", "/explorer/api/live")
        assert explorer.getresponse().read()  # a keep-alive connection stays open
        os.killpg(server.pid, signal.SIGINT)  # as Ctrl-C in a terminal: to the whole process group
        output, _ = server.communicate(timeout=30)
        assert server.returncode == 0 and "stopping" in output, output[-3000:]
        assert "Traceback" not in output and "CancelledError" not in output, output[-3000:]
        for stream in streams:
            events = [line[len(b"data: ") :] for line in stream.read().split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["message"] == "server shutting down" and error["code"] == "unavailable", error
        printed, said = generate.communicate(timeout=30)
        assert generate.returncode == 1 and printed.endswith("\n"), (printed[-200:], said)
        assert said.startswith("error: the answer ended early, after ") and "server shutting down" in said, said
        assert said.count("\n") == 1, said
    finally:
        for conn in connections:
            conn.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


# ---- the HTTP server's own limits (no deployment) -------------------------------------------------------


class AppServer:
    """A FastAPI app behind ``FrontDoor`` on ``HttpServer``, in an event loop of its own thread."""

    def __init__(self, app: FastAPI, tls: ssl.SSLContext | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = HttpServer(app, "127.0.0.1", 0, tls=tls)
        self.port = self.call(self.server.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def small_app() -> Iterator[tuple[AppServer, dict[str, Any]]]:
    seen: dict[str, Any] = {"parsed": 0, "cancelled": 0}
    app = FastAPI()
    app.add_middleware(FrontDoor, auth_token=TOKEN, max_body_bytes=1000)

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, Any]:
        seen["parsed"] += 1
        return {"size": len(await request.body())}

    @app.post("/v1/slow")
    async def slow(request: Request) -> dict[str, Any]:
        async def work() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen["cancelled"] += 1
                raise

        await request.body()
        await _unless_disconnected(request, work())
        return {}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    server = AppServer(app)
    yield server, seen
    server.close()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_body_over_the_limit_is_refused_413_before_it_is_parsed(small_app):
    server, seen = small_app
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    status, body = post(conn, "/v1/echo", {"x": "a" * 100}, AUTH)
    assert status == 200 and seen["parsed"] == 1
    status, body = post(conn, "/v1/echo", {"x": "a" * 2000}, AUTH)
    assert status == 413 and "over the limit of 1000 bytes" in body["error"]["message"], body
    assert body["error"]["code"] == "request_too_large"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # a chunked body: no Content-Length
    conn.request("POST", "/v1/echo", iter([b"a" * 600, b"b" * 600]), {**AUTH}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and b"over the limit" in response.read()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/echo", iter([b"a" * 300, b"b" * 300]), {**AUTH}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read()) == {"size": 600}
    assert seen["parsed"] == 2  # neither large body reached the endpoint


@pytest.mark.parametrize("chunked", [True, False])
def test_a_50_mb_body_sent_whole_before_reading_gets_a_413_it_can_read(small_app, chunked):
    """A client that sends its whole body before it reads the answer (http.client does) gets the 413, not a
    reset: the refused body is read and dropped before the connection closes."""
    server, seen = small_app
    piece = b"x" * (1 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {**AUTH} if chunked else {**AUTH, "Content-Length": str(50 * len(piece))}
    conn.request("POST", "/v1/echo", iter([piece] * 50), headers, encode_chunked=chunked)
    response = conn.getresponse()
    body = json.loads(response.read())
    assert response.status == 413 and body["error"]["code"] == "request_too_large", body
    assert response.getheader("Connection") == "close" and seen["parsed"] == 0
    conn.close()
    again = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    assert post(again, "/v1/echo", {"x": 1}, AUTH)[0] == 200  # the server serves on


def test_the_token_guards_v1_and_the_explorer_api_but_not_health(small_app):
    server, _ = small_app
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for path in ("/v1/echo", "/explorer/api/burst"):
        status, body = post(conn, path, {})
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)
        status, _ = post(conn, path, {}, {"Authorization": "Bearer wrong"})
        assert status == 401
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_a_client_that_disconnects_cancels_its_work(small_app):
    server, seen = small_app
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/slow", b"{}", {"Content-Type": "application/json", **AUTH})
    time.sleep(0.5)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 5
    while seen["cancelled"] == 0:
        assert time.monotonic() < deadline, "the endpoint's work was not cancelled when its client went away"
        time.sleep(0.05)


def test_https_with_the_grpc_certificate_options(tmp_path: Path):
    ca, cert, key = make_ca_and_server_cert()
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    server = AppServer(app, tls=server_tls_context(cert, key))
    try:
        trusting = ssl.create_default_context(cadata=ca.decode())
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=30, context=trusting)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        with pytest.raises(ssl.SSLCertVerificationError):
            conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=30)  # the system's CAs only
            conn.request("GET", "/health")
        plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/health")
            plain.getresponse()
    finally:
        server.close()


def test_a_token_protected_http_server_off_loopback_needs_tls():
    for change in ({"http_port": 8000}, {"explorer_port": 8001, "explorer_host": "0.0.0.0"}):
        config = {"host": "0.0.0.0", "auth_token": TOKEN, **change}
        with pytest.raises(ValueError, match="needs TLS"):
            DeploymentConfig(**config)
        DeploymentConfig(**config, tls_cert_file="c.pem", tls_key_file="k.pem")  # with TLS it may
        DeploymentConfig(**{**config, "auth_token": None})  # without a token there is nothing to leak
    DeploymentConfig(http_port=8000, auth_token=TOKEN)  # loopback


def test_a_token_protected_grpc_server_off_loopback_needs_tls():
    with pytest.raises(ValueError, match=r"port \(gRPC\) on .* needs TLS"):
        DeploymentConfig(host="0.0.0.0", auth_token=TOKEN)
    DeploymentConfig(host="0.0.0.0", auth_token=TOKEN, tls_cert_file="c.pem", tls_key_file="k.pem")
    DeploymentConfig(host="0.0.0.0")  # without a token there is nothing to leak


# ---- the explorer's bounds (no deployment) --------------------------------------------------------------


def test_the_playground_cost_counts_instances():
    heavy = {"prompt_len": 32768, "chunk_size": 64, "num_decodes": 24}  # allowed on one instance, not on 8
    PlaygroundSettings.parse(heavy)
    with pytest.raises(SettingError, match="on 8 instance") as e:
        PlaygroundSettings.parse({**heavy, "instances": 8})
    assert e.value.field == "chunk_size"
    with pytest.raises(SettingError, match="on 16 instance"):
        PlaygroundSettings.parse({**heavy, "mode": "disaggregated", "prefill": 8, "decode": 8})


def test_playground_runs_go_to_a_worker_process_one_waiting_per_client():
    async def scenario() -> None:
        runner = PlaygroundRunner(max_waiting=2)
        try:
            first = await runner.run("a", PlaygroundSettings())
            assert first["runs"][0]["figures"]["steps_in_window"] == 8
            (pid,) = [p.pid for p in runner._pool._processes.values()]
            assert pid != os.getpid()
            slow = PlaygroundSettings(prompt_len=32768, chunk_size=64, num_decodes=60)
            running = asyncio.ensure_future(runner.run("a", slow))
            await asyncio.sleep(0.05)
            replaced = asyncio.ensure_future(runner.run("a", PlaygroundSettings(chunk_size=512)))
            await asyncio.sleep(0.05)
            newest = asyncio.ensure_future(runner.run("a", PlaygroundSettings(chunk_size=256)))
            other = asyncio.ensure_future(runner.run("b", PlaygroundSettings()))
            await asyncio.sleep(0.05)
            with pytest.raises(PlaygroundRefused) as refused:
                await runner.run("c", PlaygroundSettings())  # two clients wait already
            assert refused.value.status == 429
            with pytest.raises(PlaygroundRefused) as e:
                await replaced
            assert e.value.status == 409
            assert (await newest)["runs"][0]["figures"]["steps_in_window"] == 32
            assert (await other)["settings"] == asdict(PlaygroundSettings())
            assert (await running)["settings"] == asdict(slow)
            with pytest.raises(SettingError, match="takes at most") as bad:  # raised in the worker, as in a thread
                await runner.run("a", PlaygroundSettings(model="Llama-3-8B", prompt_len=900_000))
            assert bad.value.field == "prompt_len"
        finally:
            runner.close()

    asyncio.run(scenario())


def test_a_playground_run_over_its_time_is_stopped():
    async def scenario() -> None:
        runner = PlaygroundRunner(timeout_s=0.5)
        try:
            with pytest.raises(PlaygroundRefused) as e:
                await runner.run("a", PlaygroundSettings(prompt_len=32768, chunk_size=64, num_decodes=60))
            assert e.value.status == 503 and runner._pool is None
            runner.timeout_s = 60
            assert (await runner.run("a", PlaygroundSettings()))["runs"]
        finally:
            runner.close()

    asyncio.run(scenario())


class FakeRouter:
    """What ``Bursts`` uses of a router: limits, the default mode, and ``generate`` (slow here)."""

    class limits:
        max_model_len = 2048
        vocab_size = 100

    class config:
        default_mode = "colocated"

    async def generate(self, request: Any) -> Any:
        await asyncio.sleep(0.3)
        yield None


def test_one_burst_at_a_time():
    async def scenario() -> None:
        bursts = Bursts(FakeRouter())  # type: ignore[arg-type]
        first = bursts.start(BurstSpec(streams=2, long_prompts=0))
        with pytest.raises(BurstBusy, match=f"{first.id} is still running"):
            bursts.start(BurstSpec(streams=1, long_prompts=0))
        while first.ended is None:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)
        assert first.done == 2
        assert bursts.start(BurstSpec(streams=1, long_prompts=0)).requests == 1
        await bursts.close()

    asyncio.run(scenario())


# ---- a deployment with every door closed: token, TLS, body limit, queue-time bound ---------------------

ENGINE = EngineConfig(
    model="tiny",
    device="cpu",
    num_kv_blocks=1100,  # four 4000-token runners
    max_num_seqs=4,
    max_num_batched_tokens=32,
    torch_threads=1,
    max_model_len=4096,
)
MAX_QUEUE_TIME_S = 3.0
MAX_REQUEST_BYTES = 64 << 10
DEFAULT_CHAT_MAX_TOKENS = 6
RUNNERS = 4  # max_num_seqs: while these decode, a fifth request gets no first token


class Closed:
    """A deployment behind a token and TLS, and the CA its clients trust."""

    def __init__(self, deployment: Deployment, ca: bytes) -> None:
        self.d = deployment
        self.ca = ca
        self.tls = ssl.create_default_context(cadata=ca.decode())

    def https(self, port: int | None = None, timeout: float = 60) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", port or self.d.http_port, timeout=timeout, context=self.tls)

    def client(self) -> Client:
        return Client(self.d.address, auth_token=TOKEN, root_certificates=self.ca)

    def num_active(self) -> int:
        """``Stats.num_active_requests``, as the router's gRPC API answers it."""
        with self.client() as c:
            return c._stub.Stats(pb.StatsRequest(), timeout=30, metadata=c._md).num_active_requests

    def metric(self, name: str, **labels: str) -> float:
        """A sample of router 0's ``/metrics`` (served over HTTPS too), 0 when absent."""
        from prometheus_client.parser import text_string_to_metric_families

        conn = self.https(self.d.metrics_ports[0])
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def active_gauge(self) -> float:
        return self.metric("pdserve_router_active_requests")

    def wait_no_active(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_active() != 0:
            assert time.monotonic() < deadline, f"{self.num_active()} requests still counted active"
            time.sleep(0.05)
        assert self.active_gauge() == 0


@pytest.fixture(scope="module")
def closed(ray_cluster, tmp_path_factory) -> Iterator[Closed]:
    ca, cert, key = make_ca_and_server_cert()
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert)
    (folder / "key.pem").write_bytes(key)
    config = DeploymentConfig(
        engine=ENGINE,
        transport="grpc",
        http_port=0,
        metrics_port=0,
        explorer_port=0,
        auth_token=TOKEN,
        tls_cert_file=str(folder / "cert.pem"),
        tls_key_file=str(folder / "key.pem"),
        router=RouterConfig(
            max_queue_time_s=MAX_QUEUE_TIME_S,
            max_request_bytes=MAX_REQUEST_BYTES,
            default_chat_max_tokens=DEFAULT_CHAT_MAX_TOKENS,
        ),
    )
    with Deployment(config) as d:
        yield Closed(d, ca)


def completion(max_tokens: int, stream: bool = False, prompt: str = "Hello there") -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


@pytest.mark.cluster
def test_a_client_gone_mid_stream_is_no_longer_counted_active(closed: Closed):
    conn = closed.https()
    open_stream(conn, headers=AUTH)
    assert closed.num_active() == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    closed.wait_no_active(10)
    for _ in range(40):
        status, body = post(closed.https(), "/v1/completions", completion(2), AUTH)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    assert closed.num_active() == 0 and closed.active_gauge() == 0
    assert_no_leaks(closed.d, auth_token=TOKEN, root_certificates=closed.ca)


@pytest.mark.cluster
def test_a_client_gone_before_a_whole_answer_aborts_its_request(closed: Closed):
    conn = closed.https()
    conn.request("POST", "/v1/completions", json.dumps(completion(1000)), {"Content-Type": "application/json", **AUTH})
    deadline = time.monotonic() + 10
    while closed.num_active() == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    closed.wait_no_active(3)  # 1000 tokens take far longer than this here
    assert_no_leaks(closed.d, auth_token=TOKEN, root_certificates=closed.ca)


@pytest.mark.cluster
def test_a_body_over_max_request_bytes_gets_413(closed: Closed):
    status, body = post(closed.https(), "/v1/completions", completion(2, prompt="x" * MAX_REQUEST_BYTES), AUTH)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert f"limit of {MAX_REQUEST_BYTES} bytes" in body["error"]["message"]


@pytest.mark.cluster
def test_chat_without_max_tokens_gets_the_bounded_default(closed: Closed):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    status, answer = post(closed.https(), "/v1/chat/completions", body, AUTH)
    assert status == 200 and answer["usage"]["completion_tokens"] == DEFAULT_CHAT_MAX_TOKENS, answer
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.cluster
def test_the_http_api_speaks_tls_only(closed: Closed):
    plain = http.client.HTTPConnection("127.0.0.1", closed.d.http_port, timeout=30)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/health")
        plain.getresponse()
    conn = closed.https()
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200  # open without the token, for probes
    status, _ = post(closed.https(), "/v1/completions", completion(2))
    assert status == 401


@pytest.mark.cluster
def test_a_request_past_max_queue_time_is_refused_429_and_resource_exhausted(closed: Closed):
    rejected_before = closed.metric("pdserve_requests_total", outcome="rejected")
    runners = [closed.https() for _ in range(RUNNERS)]
    try:
        for conn in runners:  # long enough to outlast two max_queue_time waits on a fast CPU
            open_stream(conn, max_tokens=4000, headers=AUTH)
        started = time.monotonic()
        status, body = post(closed.https(), "/v1/completions", completion(2), AUTH)
        waited = time.monotonic() - started
        assert status == 429 and body["error"]["code"] == "resource_exhausted", body
        assert "max_queue_time_s=3" in body["error"]["message"]
        assert MAX_QUEUE_TIME_S - 0.1 < waited < MAX_QUEUE_TIME_S + 3
        with closed.client() as c, pytest.raises(grpc.RpcError) as e:
            list(c.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_time_s" in e.value.details()
        assert closed.num_active() == RUNNERS  # the refused ones are gone
        assert closed.metric("pdserve_requests_total", outcome="rejected") == rejected_before + 2
    finally:
        for conn in runners:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    closed.wait_no_active(10)
    assert_no_leaks(closed.d, auth_token=TOKEN, root_certificates=closed.ca)


@pytest.mark.cluster
def test_the_explorer_needs_the_token_and_sends_one_burst_at_a_time(closed: Closed):
    conn = closed.https(closed.d.explorer_port)
    conn.request("GET", "/")
    response = conn.getresponse()
    assert response.status == 200 and b"pdserve explorer" in response.read()  # the page itself is open
    for method, path in (
        ("GET", "/explorer/api/options"),
        ("GET", "/explorer/api/live"),
        ("POST", "/explorer/api/burst"),
    ):
        conn.request(method, path, b"{}" if method == "POST" else None)
        response = conn.getresponse()
        assert response.status == 401, (path, response.read())
        response.read()
    burst = {"streams": 2, "long_prompts": 0, "stream_output_tokens": 200, "long_prompt_tokens": 100}
    status, first = post(conn, "/explorer/api/burst", burst, AUTH)
    assert status == 202, first
    status, refused = post(conn, "/explorer/api/burst", burst, AUTH)
    assert status == 429 and f"{first['id']} is still running" in refused["error"]["message"]
    deadline = time.monotonic() + 60
    while True:
        conn.request("GET", "/explorer/api/live", headers=AUTH)
        live = json.loads(conn.getresponse().read())
        if live["bursts"][-1]["ended"]:
            break
        assert time.monotonic() < deadline, live["bursts"]
        time.sleep(0.2)
    assert live["bursts"][-1]["done"] == 2
    status, _ = post(conn, "/explorer/api/burst", {**burst, "streams": 1}, AUTH)
    assert status == 202  # the next one, once the first has ended
    closed.wait_no_active(30)
    assert_no_leaks(closed.d, auth_token=TOKEN, root_certificates=closed.ca)


# ---- the router's accounting and queue-time bound (workers faked: no Ray) -------------------------------


class FakeWorker:
    """A decode worker that accepts requests and never sends a token; its aborts take ``abort_s``."""

    def __init__(self, abort_s: float = 0.0) -> None:
        self.abort_s = abort_s
        self.aborted: list[str] = []
        self.generate = SimpleNamespace(remote=self._generate)
        self.abort = SimpleNamespace(remote=self._abort)

    async def _generate(self, key: str, *args: Any) -> None:
        return None

    async def _abort(self, key: str) -> None:
        await asyncio.sleep(self.abort_s)
        self.aborted.append(key)


def fake_router(worker: FakeWorker, **config: Any) -> Router:
    decode = WorkerHandle("decode-0", "decode", worker)
    return Router(RouterConfig(**config), [decode], [], ModelLimits(100, 256), None)


async def consume(router: Router, request_id: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for _ in router.generate(GenerateInput(request_id, [1, 2, 3], params, None)):
        pass


def test_a_consumer_that_cancels_twice_leaves_no_active_request():
    """What an HTTP server does to a stream whose client went away: cancel, and cancel again during cleanup."""

    async def scenario() -> None:
        worker = FakeWorker(abort_s=0.3)
        router = fake_router(worker)
        task = asyncio.ensure_future(consume(router, "gone"))
        await asyncio.sleep(0.1)
        assert list(router.active) == ["gone"]
        task.cancel()
        await asyncio.sleep(0.05)  # the stream now waits for its abort on the worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert router.active == {}
        await asyncio.sleep(0.4)
        assert len(worker.aborted) == 1  # the abort still reached the worker
        again = asyncio.ensure_future(consume(router, "gone"))  # and the id is free for a new request
        await asyncio.sleep(0.1)
        assert list(router.active) == ["gone"] and not again.done()
        again.cancel()
        with pytest.raises(asyncio.CancelledError):
            await again

    asyncio.run(scenario())


def test_a_request_without_its_first_token_in_max_queue_time_is_refused_and_aborted():
    async def scenario() -> None:
        worker = FakeWorker()
        router = fake_router(worker, max_queue_time_s=0.3)
        started = time.monotonic()
        with pytest.raises(RequestError) as e:
            await consume(router, "late")
        assert 0.3 <= time.monotonic() - started < 2
        assert e.value.code == "RESOURCE_EXHAUSTED" and "max_queue_time_s=0.3" in str(e.value)
        assert router.active == {} and router.num_queued == 0
        for _ in range(100):  # the abort goes out as the client gets its status, not before
            if worker.aborted:
                break
            await asyncio.sleep(0.01)
        assert len(worker.aborted) == 1
        assert router.metrics.requests.labels(mode="colocated", outcome="rejected")._value.get() == 1

    asyncio.run(scenario())
