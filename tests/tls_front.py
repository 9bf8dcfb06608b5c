"""TLS for tests: certificates from a throwaway CA, and a TLS front for the
Temporal dev server.

``temporal server start-dev`` (CLI 1.9) cannot serve TLS: its server config is
built in code with no TLS block and no flag or config file to add one. The
nearest real server is therefore the dev server behind :class:`TlsFront`, a
TLS endpoint (OpenSSL through Python's ``ssl``, ALPN ``h2`` as gRPC needs)
that passes the decrypted bytes to the dev server on loopback. Clients see a
real handshake with a real certificate chain, and with ``client_ca`` a real
mTLS server that refuses a client without a certificate from that CA.
"""

import asyncio
import ssl
import subprocess
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Pki:
    """PEM files of one CA, a server certificate and a client certificate."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(root: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA (basicConstraints CA:TRUE, as rustls requires)."""
    cert, key = root / f"{name}.pem", root / f"{name}.key"
    _openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2"),
        *("-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    return cert, key


def issue(
    root: Path, name: str, ca: tuple[Path, Path], usage: str, san: str = ""
) -> tuple[Path, Path]:
    """A leaf certificate signed by ``ca`` for ``usage`` (serverAuth or clientAuth)."""
    cert, key, csr, ext = (root / f"{name}{s}" for s in (".pem", ".key", ".csr", ".ext"))
    _openssl(
        *("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}"),
    )
    lines = ["basicConstraints=CA:FALSE", f"extendedKeyUsage={usage}"]
    if san:
        lines.append(f"subjectAltName={san}")
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1])),
        *("-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)),
    )
    return cert, key


def make_pki(root: Path) -> Pki:
    """A CA, a server certificate for localhost and 127.0.0.1, and a client certificate."""
    root.mkdir(parents=True, exist_ok=True)
    ca = make_ca(root, "test-ca")
    server = issue(root, "server", ca, "serverAuth", "DNS:localhost,IP:127.0.0.1")
    client = issue(root, "client", ca, "clientAuth")
    return Pki(ca[0], ca[1], server[0], server[1], client[0], client[1])


@dataclass
class Handshakes:
    """What the front saw, for tests to tell a refusal by TLS from anything else."""

    done: int = 0
    failed: list[str] = field(default_factory=list)


class TlsFront:
    """A TLS listener on 127.0.0.1:``port`` in front of ``target`` (host:port).

    It runs its own event loop in a thread, so that tests blocking in
    synchronous waits do not stall the processes talking through it.
    """

    def __init__(
        self, port: int, target: str, cert: Path, key: Path, client_ca: Path | None = None
    ) -> None:
        self.port = port
        host, _, target_port = target.rpartition(":")
        self._target = (host, int(target_port))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["h2"])
        if client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(client_ca)
        self._ctx = ctx
        self.handshakes = Handshakes()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._serving: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Listen; returns once the port accepts connections."""
        self._thread.start()
        self._call(self._listen()).result(10)

    def stop(self) -> None:
        """Close the listener and every connection, then end the thread."""
        if self._server is not None:
            self._call(self._close()).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _call(self, work: Coroutine[Any, Any, None]) -> Future[None]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._serving:
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            await self._relay(reader, writer)
        finally:
            self._serving.discard(task)
            writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The handshake is done here rather than by start_server(ssl=...), so
        # that a refused one is recorded instead of only logged by asyncio.
        try:
            await writer.start_tls(self._ctx, ssl_handshake_timeout=10)
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            self.handshakes.failed.append(f"{type(exc).__name__}: {exc}")
            return
        self.handshakes.done += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError):
        pass
    finally:
        writer.close()
