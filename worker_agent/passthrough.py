"""The authenticating pass-through in front of every engine's HTTP port.

An engine key alone does not close an engine: vLLM checks ``VLLM_API_KEY``
only under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, and leaves
``/invocations`` (full completions), ``/adapters`` (loads LoRA from a path),
``/metrics``, ``/tokenize`` and more open to anyone who reaches the port
(DESIGN §5). So engines bind loopback only, and the agent starts this
pass-through on the node's address: every request, on every path, must carry
``Authorization: Bearer <the replica's engine key>`` (compared in constant
time), or it is answered 401 without reaching the engine. What passes goes to
the engine unchanged (the key included, so an engine's own check still
applies) and the answer, SSE streams included, comes back chunk by chunk.

It runs as a process of the shard (the first of its process group), not in
the agent, so it lives and dies with its engine: it survives an agent
restart the way the engine does, and one group signal stops both. The key
comes by environment (``LLMGW_PASSTHROUGH_KEY``), never argv.

``python -m worker_agent.passthrough --listen HOST:PORT --upstream URL``.
"""

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

KEY_ENV = "LLMGW_PASSTHROUGH_KEY"
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
    }
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_REFUSED = json.dumps(
    {
        "error": {
            "message": "this engine answers only its router (engine key required)",
            "type": "authentication_error",
            "code": "invalid_api_key",
            "param": None,
        }
    }
).encode()


class PassThrough:
    """An ASGI app: check the key, then relay the request to ``upstream``."""

    def __init__(self, upstream: str, key: str, http: httpx.AsyncClient | None = None) -> None:
        if not key:
            raise ValueError("the pass-through needs the engine key")
        self._upstream = upstream.rstrip("/")
        self._expected = f"Bearer {key}".encode()
        # No pool limit: the router bounds concurrency; no read timeout: a
        # long generation streams for as long as it streams.
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(10.0, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def _send(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._http.send(request, stream=True)
        except httpx.RemoteProtocolError:
            # The engine closed an idle kept-alive connection just as it was
            # reused: it never read the request, so sending it again is safe
            # (seen as one 502 in 200 requests under `llmgw bench`).
            return await self._http.send(request, stream=True)

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request carries the engine key, compared in constant time."""
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self._http)
            return
        if scope["type"] != "http":
            return  # websockets: engines serve none we front
        if not self.authorized(scope["headers"]):
            await _respond(send, 401, _REFUSED)
            return
        body = await _read_body(receive)
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = self._upstream + path.decode("latin-1") + (f"?{query.decode()}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP]
        request = self._http.build_request(scope["method"], url, headers=headers, content=body)
        try:
            upstream = await self._send(request)
        except httpx.HTTPError as exc:
            message = {"error": {"message": f"engine unreachable: {type(exc).__name__}"}}
            await _respond(send, 502, json.dumps(message).encode())
            return
        try:
            await self._relay(upstream, receive, send)
        finally:
            await upstream.aclose()

    async def _relay(self, upstream: httpx.Response, receive: Receive, send: Send) -> None:
        out_headers = [(k, v) for k, v in upstream.headers.raw if k.lower() not in _HOP_BY_HOP]
        await send(
            {"type": "http.response.start", "status": upstream.status_code, "headers": out_headers}
        )
        # A client that goes away must not leave the engine generating for nobody:
        # closing the upstream response closes the engine's connection, which it
        # takes as an abort.
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            async for chunk in upstream.aiter_raw():
                if gone.done():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send, http: httpx.AsyncClient) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            # SIGTERM reaches the pass-through with its engine (one group signal),
            # after the replica drained: nothing is left to finish, and lingering
            # would only keep the shard's group, and its stop, alive.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, os._exit, 0)
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await http.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return


def command(python: str, listen_host: str, listen_port: int, upstream: str) -> list[str]:
    """The argv that runs a pass-through (the key goes by ``KEY_ENV``)."""
    listen = f"[{listen_host}]" if ":" in listen_host else listen_host
    return [
        python,
        "-m",
        "worker_agent.passthrough",
        "--listen",
        f"{listen}:{listen_port}",
        "--upstream",
        upstream,
    ]


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM (uvicorn's own handling), with the key from the environment."""
    import uvicorn  # noqa: PLC0415 - only the process that serves needs it

    parser = argparse.ArgumentParser(description="Authenticating pass-through to an engine.")
    parser.add_argument("--listen", required=True, help="HOST:PORT on the node's address")
    parser.add_argument("--upstream", required=True, help="the engine's loopback URL")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        print(f"error: {KEY_ENV} is not set", file=sys.stderr)
        return 2
    app = PassThrough(args.upstream, key)
    uvicorn.run(
        app,
        host=host.strip("[]"),
        port=int(port),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
