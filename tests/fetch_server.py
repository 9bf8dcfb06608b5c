"""A loopback HTTP file server with Range support and faults injected per request.

Started by a test (``FileServer`` as a context manager: its own asyncio loop in a
thread), it serves generated files and counts the body bytes it sent per path,
so a test can say how much was fetched again. Faults queue per path, one per
request: a status (with headers), a cut after N bytes, a stall after N bytes
(until the server stops), a pause after N bytes (until ``release``), wrong
bytes, a Range ignored.

Also a child entry point (``python -m tests.fetch_server child SPEC``): one
ArtifactCache fetch in its own process, for the SIGKILL and single-flight tests.
"""

import asyncio
import contextlib
import hashlib
import json
import re
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from worker_agent.fetch import ArtifactCache, ArtifactSpec, FetchPolicy, FileSpec

CHUNK = 64 * 1024
_RANGE = re.compile(r"bytes=(\d+)-")


@dataclass(frozen=True)
class Fault:
    """One request's misbehaviour. ``kind``: status, cut, stall, pause, wrong, ignore_range."""

    kind: str
    status: int = 0
    after: int = 0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    path: str
    range: str | None
    authorization: str | None


class FileServer:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.etags = {p: hashlib.sha256(d).hexdigest()[:16] for p, d in files.items()}
        self.faults: dict[str, list[Fault]] = defaultdict(list)
        self.served: dict[str, int] = defaultdict(int)
        self.requests: list[Seen] = []
        self.paused = threading.Event()  # set when a pause fault is reached
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._release = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self.port = 0
        self._handlers: set[asyncio.Task[None]] = set()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def __enter__(self) -> "FileServer":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the file server did not start")
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            server.close()
            # Handlers stalled or paused end on the stop; their sockets close before the loop.
            await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1].lstrip("/")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            self.requests.append(Seen(path, headers.get("range"), headers.get("authorization")))
            fault = self.faults[path].pop(0) if self.faults[path] else None
            await self._answer(writer, path, headers, fault)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        path: str,
        headers: dict[str, str],
        fault: Fault | None,
    ) -> None:
        if path not in self.files:
            return await self._status(writer, 404, {})
        if fault is not None and fault.kind == "status":
            return await self._status(writer, fault.status, fault.headers)
        data = self.files[path]
        if fault is not None and fault.kind == "wrong":
            data = bytes(b ^ 0xFF for b in data[:16]) + data[16:]
        start = 0
        match = _RANGE.fullmatch(headers.get("range", ""))
        if match and not (fault is not None and fault.kind == "ignore_range"):
            start = int(match[1])
        head = [
            "HTTP/1.1 206 Partial Content" if start else "HTTP/1.1 200 OK",
            f"Content-Length: {len(data) - start}",
            f"ETag: {self.etags[path]}",
            "Accept-Ranges: bytes",
            "Connection: close",
        ]
        if start:
            head.append(f"Content-Range: bytes {start}-{len(data) - 1}/{len(data)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        await self._body(writer, path, data, start, fault)

    async def _body(
        self, writer: asyncio.StreamWriter, path: str, data: bytes, start: int, fault: Fault | None
    ) -> None:
        sent = start
        while sent < len(data):
            if (
                fault is not None
                and fault.kind in ("cut", "stall", "pause")
                and sent >= fault.after
            ):
                if fault.kind == "cut":
                    return
                if fault.kind == "stall":
                    await self._stop.wait()
                    return
                self.paused.set()
                # Ended by release, or by the server's stop: a connection whose client
                # was killed is never written to again (its bytes would count as served).
                waits = [asyncio.ensure_future(e.wait()) for e in (self._release, self._stop)]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                if self._stop.is_set():
                    return
                fault = None
            end = min(len(data), sent + CHUNK)
            if fault is not None and fault.kind in ("cut", "stall", "pause"):
                end = min(end, max(fault.after, sent + 1))
            writer.write(data[sent:end])
            await writer.drain()
            self.served[path] += end - sent
            sent = end

    async def _status(
        self, writer: asyncio.StreamWriter, status: int, extra: dict[str, str]
    ) -> None:
        head = [f"HTTP/1.1 {status} Fault", "Content-Length: 0", "Connection: close"]
        head += [f"{k}: {v}" for k, v in extra.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        await writer.drain()


def child(spec_json: str) -> None:
    """Fetch one artifact described as JSON {root, files: [[url, rel, size, sha]], user}."""
    spec = json.loads(spec_json)
    artifact = ArtifactSpec(tuple(FileSpec(u, r, n, s) for u, r, n, s in spec["files"]))
    cache = ArtifactCache(
        Path(spec["root"]), policy=FetchPolicy(disk_margin_bytes=0, backoff_s=0.05)
    )
    got = cache.fetch(artifact, user=spec.get("user"))
    print(json.dumps({"path": str(got.path), "cached": got.cached}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2])
