"""``pdserve serve`` refuses ports it cannot listen on before it starts anything: one line, exit status 2."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pdserve.cli.main import main
from pdserve.net import reuse_port_socket


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here may start Ray: a check that came too late would fail the test at once."""
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray started before the ports were checked")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def serve(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["serve", "--model", "tiny", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "99999"], "port must be a port number in 1-65535, or 0 for any free port; got 99999"),
        (["--http-port", "-5"], "http_port must be a port number in 1-65535, or 0 for any free port; got -5"),
        (["--explorer-port", "70000"], "explorer_port must be a port number"),
        (["--port", "8123", "--http-port", "8123"], "http_port 8123 is also the port on 127.0.0.1"),
        (["--metrics-port", "65535", "--routers", "2"], "metrics_port 65535 + one port per router (2) passes 65535"),
    ],
)
def test_a_port_that_is_no_port_is_one_line(capsys, argv, words):
    code, err = serve(capsys, *argv)
    assert code == 2 and err.startswith(f"error: {words}") and err.count("\n") == 1, err


@pytest.mark.parametrize("option", ["--port", "--http-port", "--explorer-port", "--metrics-port"])
def test_a_busy_port_is_one_line_naming_it_before_ray_starts(capsys, busy_port, option):
    argv = [option, str(busy_port)] if option == "--port" else ["--port", "0", option, str(busy_port)]
    code, err = serve(capsys, *argv)
    name = option[2:].replace("-", "_")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {name}: cannot listen on 127.0.0.1:{busy_port} (in use); stop what listens there")


def test_a_port_another_server_shares_with_so_reuseport_counts_as_busy(capsys):
    """A router of another deployment listens with SO_REUSEPORT: a second one would silently share its port."""
    other = reuse_port_socket("127.0.0.1", 0)
    try:
        code, err = serve(capsys, "--port", str(other.getsockname()[1]))
    finally:
        other.close()
    assert code == 2 and "(in use)" in err, err


def test_a_client_target_port_out_of_range_is_refused(capsys):
    assert main(["generate", "hi", "--target", "127.0.0.1:99999"]) == 2
    assert capsys.readouterr().err == "error: --target: HOST:PORT with a port in 1-65535, got '127.0.0.1:99999'\n"
