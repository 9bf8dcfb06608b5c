"""A fast mock OpenAI upstream and a tiny HTTP/1.1 client, for benchmarks.

The mock answers ``POST /v1/chat/completions`` at once (JSON, or SSE when the
body asks for a stream) with nothing but byte writes; the client keeps
connections alive and parses just enough HTTP/1.1 to time a response. Both
stay well below the cost of the proxies they measure.
"""

import asyncio
import importlib
import json
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

MODEL = "bench"
TOKENS = 16
T = TypeVar("T")


def has_module(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def run_loop(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run on uvloop when installed (as uvicorn does), else asyncio's loop."""
    factory = importlib.import_module("uvloop").new_event_loop if has_module("uvloop") else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


# --- the mock upstream -------------------------------------------------------

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok " * TOKENS},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": TOKENS, "total_tokens": 8 + TOKENS},
    }
).encode()


def _event(delta: dict[str, str], finish: str | None = None) -> bytes:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    # Compact, as llama.cpp and vLLM write it (the router counts content by a byte pattern).
    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_COMPLETION), _COMPLETION)
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + _event({"role": "assistant", "content": "ok "})
)
# One write per token after the first, as engines stream; the last with the
# finish reason, [DONE] and the end of the chunked body.


def stream_rest(tokens: int) -> list[bytes]:
    """The writes after the head of a stream of ``tokens`` tokens."""
    return [_event({"content": "ok "}) for _ in range(tokens - 2)] + [
        _event({"content": "ok "}) + _event({}, "stop") + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    ]


STREAM_REST = stream_rest(TOKENS)


# A request's own stream length (the benchmark's long streams), else the mock's.
_MOCK_TOKENS = re.compile(rb'"mock_tokens":(\d+)')


class _Upstream(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies only (what proxies send)."""

    def __init__(self, gap_s: float, rest: list[bytes]) -> None:
        self.gap_s = gap_s
        self.rest = rest
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            body = body.replace(b" ", b"")
            asked = _MOCK_TOKENS.search(body)
            rest = stream_rest(int(asked[1])) if asked else self.rest
            self._answer(b'"stream":true' in body, rest)

    def _answer(self, stream: bool, rest: list[bytes]) -> None:
        assert self.transport is not None
        if not stream:
            self.transport.write(JSON_RESPONSE)
            return
        # The first event at once, then one token every gap, as an engine
        # decodes: time to first token and time to last differ.
        self.transport.write(STREAM_HEAD)
        loop = asyncio.get_running_loop()
        for i, event in enumerate(rest, start=1):
            loop.call_later(self.gap_s * i, self._send, event)

    def _send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def serve_upstream(port: int, gap_s: float, tokens: int = TOKENS) -> None:
    """The mock engine, until killed."""

    rest = stream_rest(tokens)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Upstream(gap_s, rest), "127.0.0.1", port, backlog=4096
        )
        await server.serve_forever()

    run_loop(main)


def request_bytes(path: str, key: str, stream: bool, tokens: int = 0) -> bytes:
    """A request; ``tokens`` asks the mock for a stream of that many (else its own)."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say ok."}],
        "max_tokens": tokens or TOKENS,
        "stream": stream,
    }
    if tokens:
        fields["mock_tokens"] = tokens
    body = json.dumps(fields).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


class Conn:
    """One kept-alive HTTP/1.1 connection; a tiny client, faster than the servers."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, raw: bytes, gaps: list[float] | None = None
    ) -> tuple[int, float, float]:
        """Status, seconds to the first body chunk, seconds to the end; the
        longest wait between two body chunks goes to ``gaps`` when given."""
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        r, w = self.reader, self.writer
        t0 = time.perf_counter()
        w.write(raw)
        head = (await r.readuntil(b"\r\n\r\n")).lower()
        status = int(head[9:12])
        first = last = longest = 0.0
        if b"transfer-encoding: chunked" in head:
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await r.readuntil(b"\r\n")
                    break
                await r.readexactly(size + 2)
                now = time.perf_counter()
                if last:
                    longest = max(longest, now - last)
                first, last = first or now, now
            if gaps is not None:
                gaps.append(longest)
        else:
            at = head.find(b"content-length:")
            await r.readexactly(int(head[at + 15 :].split(b"\r\n", 1)[0]))
        end = time.perf_counter()
        if b"connection: close" in head:
            await self.close()
        return status, (first or end) - t0, end - t0

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Pair:
    """The same sequential requests direct and through a proxy, interleaved."""

    direct_total: list[float]
    proxied_total: list[float]
    direct_first: list[float]
    proxied_first: list[float]
    errors: int


async def interleaved(direct: bytes, d_port: int, proxied: bytes, p_port: int, n: int) -> Pair:
    a, b = Conn(d_port), Conn(p_port)
    out = Pair([], [], [], [], 0)
    for i in range(n + n // 10):
        status_d, first_d, total_d = await a.request(direct)
        status_p, first_p, total_p = await b.request(proxied)
        out.errors += (status_d != 200) + (status_p != 200)
        if i >= n // 10:  # warm-up dropped
            out.direct_total.append(total_d)
            out.proxied_total.append(total_p)
            out.direct_first.append(first_d)
            out.proxied_first.append(first_p)
    await a.close()
    await b.close()
    return out


def load(port: int, raw: bytes, conns: int, seconds: float) -> None:
    """Closed-loop load from one process; prints its counts as JSON."""

    async def worker(deadline: float, lat: list[float], errors: list[int]) -> None:
        c = Conn(port)
        while time.perf_counter() < deadline:
            try:
                status, _, total = await c.request(raw)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors[0] += 1
                await c.close()
                continue
            if status == 200:
                lat.append(total)
            else:
                errors[0] += 1
        await c.close()

    async def main() -> None:
        lat: list[float] = []
        errors = [0]
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(worker(deadline, lat, errors) for _ in range(conns)))
        print(json.dumps({"ok": len(lat), "errors": errors[0], "lat": lat[::10]}))

    run_loop(main)
