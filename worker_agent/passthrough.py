"""The authenticating pass-through in front of every engine's HTTP port.

An engine key alone does not close an engine: vLLM checks ``VLLM_API_KEY``
only under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, and leaves
``/invocations`` (full completions), ``/adapters`` (loads LoRA from a path),
``/metrics``, ``/tokenize`` and more open to anyone who reaches the port
(DESIGN §5). So engines bind loopback only, and the agent starts this
pass-through on the node's address: every request, on every path, must carry
``Authorization: Bearer <the replica's engine key>`` (compared in constant
time), or it is answered 401 without reaching the engine. What passes goes to
the engine unchanged but for that header, which becomes the engine's own
loopback key (``Bearer <engine key>``), and the answer, SSE streams included,
comes back chunk by chunk.

The client is aiohttp, as the router's: less than half the CPU per request
of httpx here (tests/bench/bench_passthrough.py).

It runs as a process of the shard (the first of its process group), not in
the agent, so it lives and dies with its engine: it survives an agent
restart the way the engine does, and one group signal stops both.

Keys. Every engine runs as the one engine user, so each of them can read any
other's ``/proc/<pid>/environ`` and ``cmdline``. The replica's key (what the
router sends; it opens this pass-through from anywhere on the network) is
therefore never given to an engine: the engine gets a loopback key of its
own, random per launch, that opens only its loopback port. Both keys come to
the pass-through on stdin (a pipe the agent, as root, wrote and closed:
``worker_agent/spawn.py``), one a line, never by environment or argv, and
the pass-through makes itself non-dumpable before it reads them, so other
processes of its user can read none of its ``/proc`` files (environ, fds,
memory). ``LLMGW_PASSTHROUGH_KEY`` (the replica key, which then reaches the
engine too) is read only when stdin gives none: for tools and tests run by
hand, never by the agent.

``python -I -m worker_agent.passthrough --listen HOST:PORT --upstream URL``;
``ps`` shows it as ``worker_agent.passthrough [<LLMGW_ENGINE_TITLE>] <options>``
(which replica it serves), its ``/proc/<pid>/environ`` as it was started.
"""

import argparse
import asyncio
import functools
import hmac
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs, quote

import aiohttp
from yarl import URL

from llmgw import endpoint_proof
from llmgw.errors import EngineLaunchError
from llmgw.listener import ListenerLimits, fit_open_files, limited_protocol
from worker_agent.privileges import drop_privileges_on_startup, not_dumpable

log = logging.getLogger(__name__)

KEY_ENV = "LLMGW_PASSTHROUGH_KEY"
CLOSE_FLAG = "--close-engine-connections"
# worker_agent.supervisor.TITLE_ENV, which the agent sets for every process of a
# shard (not imported: the pass-through starts with as few modules as it can).
TITLE_ENV = "LLMGW_ENGINE_TITLE"
# More than any key: stdin is a pipe of one or two lines (a key is ASCII).
_MAX_KEYS_BYTES = 4096
# Pooled engine connections are retired after this, below the engines' own
# keep-alive (5 s: vLLM's and SGLang's uvicorn), so one is never reused just
# as the engine closes it. llama.cpp's engines get none (``close_engine_connections``).
KEEPALIVE_S = 4.0
# Hop-by-hop, and Host (the engine's address goes instead). Expect too: uvicorn
# answered the client's 100-continue and the body is read; forwarded, it would
# make aiohttp wait for the engine's.
_HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-authenticate proxy-authorization te trailer"
    b" transfer-encoding upgrade host expect".split()
)
# aiohttp adds these to a request without them: the engine is to see the client's
# (an Accept-Encoding of ours could get the client an encoding it never asked for).
_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
# The listener's limits (llmgw/listener.py). It listens on the node's address,
# where anyone on that network can connect. Keep-alive stays above the
# router's pooled keep-alive (4 s, router/forwarding/upstream.py), so the router retires
# a connection before it is closed under a request; the cap is above the
# router's whole upstream pool (1024 by default).
LIMITS = ListenerLimits(header_timeout_s=10.0, keepalive_timeout_s=5, max_connections=2048)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_REFUSED = (
    b'{"error": {"message": "this engine answers only its router (engine key required)",'
    b' "type": "authentication_error", "code": "invalid_api_key", "param": null}}'
)


class PassThrough:
    """An ASGI app: check the key, then relay the request to ``upstream``."""

    def __init__(
        self,
        upstream: str,
        key: str,
        connect_timeout_s: float = 10.0,
        listen: str = "",
        engine_key: str = "",
        close_engine_connections: bool = False,
    ) -> None:
        """``listen``: the address it serves on, as ``endpoint_proof.address`` writes
        it; without it, no endpoint proof is answered (and no router routes here).
        ``engine_key``: what the engine is sent instead of ``key`` (empty: ``key``).
        ``close_engine_connections``: a connection per request, none kept alive
        (llama.cpp's engines: see ``_open``); otherwise pooled for ``KEEPALIVE_S``."""
        if not key:
            raise ValueError("the pass-through needs the engine key")
        self._upstream = upstream.rstrip("/")
        self._expected = f"Bearer {key}".encode()
        self._engine_auth = f"Bearer {engine_key or key}"
        self._key = key
        self._listen = listen
        self._close = close_engine_connections
        # No read timeout: a long generation streams for as long as it streams.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # Made on first use, in the loop that serves: a session is bound to its loop.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # No connection limit: the router bounds concurrency.
                connector=self._connector(),
                timeout=self._timeout,
                # One client's cookies must never reach another's request.
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=_NO_AUTO_HEADERS,
                # Bodies pass as the engine encoded them (Content-Encoding kept).
                auto_decompress=False,
            )
            # aiohttp resends an idempotent request after a dropped connection
            # on its own: _relay does that for every method, and only once. (A
            # private flag, as aiohttp's test client sets it; the retry test's
            # GET case fails if it stops working.)
            self._session._retry_connection = False
        return self._session

    def _connector(self) -> aiohttp.TCPConnector:
        if self._close:
            # No keep-alive for llama.cpp (issue 23 item 13): llama-server's HTTP
            # server (cpp-httplib) keeps a thread with each kept-alive connection
            # until it sends again or 5 s pass, and starts another only when none
            # is idle as a connection is queued, so a burst (a wake dispatches
            # every waiting request at once) could queue behind idle pooled
            # connections, answered 5 s late; or find pooled ones the engine had
            # closed, a 502 even after the one retry. It costs a loopback connect
            # a request (+0.2-0.4 ms, ~0.2 ms CPU: tests/bench/bench_passthrough.py),
            # which the engines whose servers have no such limit (vLLM, SGLang:
            # uvicorn) are spared.
            return aiohttp.TCPConnector(limit=0, force_close=True)
        return aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)

    async def aclose(self) -> None:
        """Close the engine connections (the lifespan's shutdown does it when served)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request carries the engine key, compared in constant time."""
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.aclose)
            return
        if scope["type"] != "http":
            return  # websockets: engines serve none we front
        if scope["path"] == endpoint_proof.PROOF_PATH:
            await self._prove(scope, send)
            return
        if not self.authorized(scope["headers"]):
            await _respond(send, 401, _REFUSED)
            return
        body = await _read_body(receive)
        # A client that goes away must not leave the engine generating for
        # nobody: its disconnect cancels this task wherever it waits (for the
        # answer or for the next chunk), which closes the engine's connection,
        # and the engine takes that as an abort.
        task = asyncio.current_task()
        assert task is not None
        relaying, cut = True, False

        def on_disconnect(_: object) -> None:
            nonlocal cut
            if relaying:
                cut = True
                task.cancel()

        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(on_disconnect)
        try:
            await self._relay(scope, body, send)
        except asyncio.CancelledError:
            # Ours (the client left): done. Anyone else's (shutdown) goes on.
            if not cut or task.uncancel() > 0:
                raise
        finally:
            relaying = False  # no await since the last one: no cancel can follow
            gone.cancel()

    async def _prove(self, scope: Scope, send: Send) -> None:
        """Answer a router's endpoint proof (llmgw/endpoint_proof.py): no key is
        asked for, none is given, and nothing reaches the engine."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        nonce = query.get(endpoint_proof.NONCE_PARAM, [""])[0]
        if not self._listen or not endpoint_proof.valid_nonce(nonce):
            await _respond(send, 400, b'{"error": {"message": "bad endpoint proof request"}}')
            return
        proof = endpoint_proof.answer(self._key, self._listen, nonce)
        await _respond(send, 200, json.dumps({"proof": proof}).encode())

    async def _relay(self, scope: Scope, body: bytes, send: Send) -> None:
        target = scope.get("raw_path") or quote(scope["path"]).encode()
        if query := scope.get("query_string"):
            target += b"?" + query
        # The client's Authorization (the replica key) is replaced by the
        # engine's loopback key, which the engine's own check (VLLM_API_KEY,
        # LLAMA_API_KEY, --api-key) wants.
        headers = [
            (
                k.decode("latin-1"),
                self._engine_auth
                if k.lower() == b"authorization"
                else v.decode("utf-8", "replace"),
            )
            for k, v in scope["headers"]
            if k.lower() not in _HOP_BY_HOP
        ]
        request = functools.partial(
            self._open().request,
            scope["method"],
            # encoded: the path goes out as the client wrote it, not re-quoted.
            URL(self._upstream + target.decode("latin-1"), encoded=True),
            headers=headers,
            data=body or None,
            allow_redirects=False,
        )
        try:
            try:
                upstream = await request()
            except aiohttp.ClientConnectorError:
                raise  # no connection at all (a ClientOSError too): not sent again
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # The engine closed (FIN) or reset (RST) the connection without
                # answering (a kept-alive one just as it was reused: one 502 in a
                # few hundred under `llmgw bench` before this retry): it never
                # answered, so sending it again is safe. Once: an engine that
                # died reading it refuses the second connection.
                log.info("engine connection lost before an answer (%r): sending again", exc)
                upstream = await request()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("engine unreachable: %r", exc)
            message = {"error": {"message": f"engine unreachable: {type(exc).__name__}"}}
            await _respond(send, 502, json.dumps(message).encode())
            return
        try:
            out = [(k, v) for k, v in upstream.raw_headers if k.lower() not in _HOP_BY_HOP]
            await send({"type": "http.response.start", "status": upstream.status, "headers": out})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Read to its end, the connection goes back to the pool; otherwise (the
            # client left, the engine broke off) it is closed: the engine sees that.
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()


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


async def _lifespan(receive: Receive, send: Send, close: Callable[[], Awaitable[None]]) -> None:
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
            await close()
            await send({"type": "lifespan.shutdown.complete"})
            return


def command(
    python: str,
    listen_host: str,
    listen_port: int,
    upstream: str,
    close_engine_connections: bool = False,
) -> list[str]:
    """The argv that runs a pass-through (the keys go on its stdin: ``keys_input``);
    ``close_engine_connections``: see ``PassThrough`` (the engine's plan says).

    ``-I``: an isolated interpreter, which puts neither the working directory
    nor anything from the environment on ``sys.path``; it may be started as
    root (worker_agent/spawn.py), and the engine user writes the directory it
    ends up in.
    """
    listen = f"[{listen_host}]" if ":" in listen_host else listen_host
    return [
        python,
        "-I",
        "-m",
        "worker_agent.passthrough",
        "--listen",
        f"{listen}:{listen_port}",
        "--upstream",
        upstream,
        *([CLOSE_FLAG] if close_engine_connections else []),
    ]


def keys_input(key: str, engine_key: str) -> bytes:
    """What the agent writes to a pass-through's stdin: the replica key, then the engine's."""
    for k in (key, engine_key):
        if not k or any(c.isspace() for c in k):
            raise EngineLaunchError("a key is one non-empty word")
    return f"{key}\n{engine_key}\n".encode()


def read_keys(environ: MutableMapping[str, str]) -> tuple[str, str]:
    """(replica key, engine key): ``KEY_ENV`` for both when set (by hand), else
    the lines on stdin, which is closed after (it becomes /dev/null)."""
    if key := environ.pop(KEY_ENV, ""):
        return key, key
    try:
        data = os.read(0, _MAX_KEYS_BYTES)
    except OSError:
        data = b""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    words = data.decode("ascii", "replace").split()
    if not words:
        return "", ""
    return words[0], words[1] if len(words) > 1 else words[0]


def title(argv: list[str], environ: MutableMapping[str, str]) -> str:
    """Its process title: ``worker_agent.passthrough [ENGINE TITLE] OPTIONS`` (no key is
    ever in its options). The module's name stays first: what .ci/leftovers looks for."""
    label = environ.get(TITLE_ENV, "")
    return " ".join(["worker_agent.passthrough", *([f"[{label}]"] if label else []), *argv])


def set_title(text: str) -> None:
    """Show ``text`` as this process's command line (``ps``, ``pgrep -f``), if
    setproctitle loads. SPT_NOENV: over the arguments only (cut to their length),
    never the environment area, whose ``/proc/<pid>/environ`` carries the engine
    marker the agent and the leftover check look for. Set through ``os.environ``,
    which ``python -I`` leaves alone (it ignores only PYTHON* variables)."""
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle  # noqa: PLC0415 - only the process that serves needs it
    except ImportError:  # an interpreter that cannot load it: untitled
        return
    setproctitle.setproctitle(text)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM (uvicorn's own handling), with the keys from stdin (``read_keys``)."""
    import uvicorn  # noqa: PLC0415 - only the process that serves needs it

    parser = argparse.ArgumentParser(description="Authenticating pass-through to an engine.")
    parser.add_argument("--listen", required=True, help="HOST:PORT on the node's address")
    parser.add_argument("--upstream", required=True, help="the engine's loopback URL")
    parser.add_argument(
        CLOSE_FLAG, action="store_true", help="a connection per request to the engine"
    )
    parser.add_argument("--header-timeout", type=float, default=LIMITS.header_timeout_s)
    parser.add_argument("--keepalive-timeout", type=int, default=LIMITS.keepalive_timeout_s)
    parser.add_argument("--max-connections", type=int, default=LIMITS.max_connections)
    args = parser.parse_args(argv)
    set_title(title(sys.argv[1:] if argv is None else argv, os.environ))
    limits = ListenerLimits(
        header_timeout_s=args.header_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        max_connections=args.max_connections,
    )
    # Engine connections: at most one a client connection.
    limits = fit_open_files(limits, other_fds=limits.max_connections)
    host, _, port = args.listen.rpartition(":")
    # Before the keys are in memory: from here on no other process of this
    # user (every engine) can read our /proc files or ptrace us.
    not_dumpable()
    key, engine_key = read_keys(os.environ)
    if not key:
        print(f"error: no key on stdin (nor {KEY_ENV} set)", file=sys.stderr)
        return 2
    listen = endpoint_proof.address(host, int(port))  # the address the router proves
    app = PassThrough(
        args.upstream,
        key,
        listen=listen,
        engine_key=engine_key,
        close_engine_connections=args.close_engine_connections,
    )
    uvicorn.run(
        # Started as root (worker_agent/spawn.py user_for): the engine user from here.
        drop_privileges_on_startup(app, os.environ),
        host=host.strip("[]"),
        port=int(port),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        # The engine's own Date and Server headers pass through: not twice.
        server_header=False,
        date_header=False,
        http=limited_protocol(limits),
        timeout_keep_alive=limits.keepalive_timeout_s,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
