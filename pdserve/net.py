"""Network helpers every front door shares: listening sockets several processes can share (``SO_REUSEPORT``),
TLS server contexts from PEM bytes (and the name a certificate is for), and an ASGI app served by uvicorn inside
a running event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import tempfile
import time
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """uvicorn in a Ray actor's event loop: the process's signal handlers stay Ray's."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


MAX_PORT = 65535


class PortUnavailable(ValueError):
    """A port a server was asked to listen on is taken, or not this process's to bind: one line says which."""


def check_port(name: str, port: int | None, allow_any: bool = True) -> None:
    """Raise ValueError unless ``port`` is a TCP port number (1-65535), or 0 for any free port where that is
    ``allow_any``; None (the server is off) passes."""
    if port is None:
        return
    low = 0 if allow_any else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= MAX_PORT:
        any_free = ", or 0 for any free port" if allow_any else ""
        raise ValueError(f"{name} must be a port number in 1-{MAX_PORT}{any_free}; got {port!r}")


def check_free(host: str, port: int, name: str) -> None:
    """Raise ``PortUnavailable`` unless a server could listen on ``host:port`` now: a probe binds it (without
    SO_REUSEPORT, so a server already sharing the port with SO_REUSEPORT counts as taking it) and lets go."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections closing on it do not count
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            raise PortUnavailable(
                f"{name}: cannot listen on {host}:{port} ({why}); stop what listens there or pick another port "
                "(0: any free port)"
            ) from None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so several router processes can share ``port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback: nothing off it can connect."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_tls_context(cert_chain: bytes, private_key: bytes) -> ssl.SSLContext:
    """A TLS server context from PEM bytes (the same certificate and key the gRPC server takes)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as folder:  # ssl loads key files only
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert_path, cert_chain), (key_path, private_key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)
    return context


def certificate_name(cert_chain: bytes) -> str:
    """A name the first certificate of a PEM chain is valid for (its first DNS or IP subject alternative name,
    else its common name): what a client that dials an address the certificate does not name checks instead."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_chain)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = names.get_values_for_type(x509.DNSName), names.get_values_for_type(x509.IPAddress)
        if dns or ips:
            return str(dns[0]) if dns else str(ips[0])
    except x509.ExtensionNotFound:
        pass
    common = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    if not common:
        raise ValueError("the TLS certificate names nothing (no subject alternative name, no common name)")
    return str(common[0].value)


class HttpServer:
    """An ASGI app served by uvicorn on a socket bound here; ``await start()``, then ``await stop()``.

    With ``tls`` (an ``ssl.SSLContext``) it serves HTTPS only.
    """

    def __init__(self, app: Any, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.sock = reuse_port_socket(host, port)
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        config.load()
        config.ssl = tls  # uvicorn takes key files only; the context is built from the PEM bytes instead
        self._server = _Server(config)
        self._task: Any = None

    async def start(self, timeout_s: float = 30.0) -> int:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
                raise RuntimeError("the HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP server did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close()
