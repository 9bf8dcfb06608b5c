"""An engine as an untrusted byte source (issue 34 §3, llmgw/bounded_http.py).

A few lines of asyncio play a hostile engine behind the real pass-through
(worker_agent/passthrough.py, served by uvicorn as on a node): a stacked gzip
bomb (590 bytes that httpx would expand to 256 MiB in one synchronous call),
a trickle (a byte every half second, forever) and an endless body. Every
check made of an engine (the agent's readiness, load and drain, liveness and
adapter calls, the router's metrics scrape, the control worker's lost-node
probe) must come back with a clean failure within its deadline, having read
no more than its cap, and asked for identity; a watch over such an engine
keeps heartbeating, and the node's other replica, watched by the same agent,
keeps its state. The router's endpoint proof asks for identity too.

That the bomb never expands is shown by memory (tracemalloc's peak), not by
time: the expansion is the one synchronous call that would hold the loop.
"""

import asyncio
import contextlib
import functools
import gzip
import json
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from activities.control.replicas import probe_endpoint
from llmgw import endpoint_proof
from llmgw.errors import AdapterLoadFailed, AdapterUnloadFailed, AgentShutdown, EngineAnswerRefused
from llmgw.types import AdapterCall, ShardRef, WatchShardInput
from router.api.engine_metrics import fetch_metrics
from router.control_link.endpoint_proof import HttpProver, Verdict
from tests.agent.test_passthrough import KEY, front, read_request
from worker_agent import adapter_service
from worker_agent.adapter_service import AdapterService
from worker_agent.engines import ReadyProbe
from worker_agent.liveness import ENGINE_HUNG, LivenessRules, Observation
from worker_agent.probes import engine_load, liveness_probe, probe_liveness, probe_ready
from worker_agent.shard_record import ShardRecord
from worker_agent.shard_service import RunningShards
from worker_agent.supervisor import RunningShard, StopOutcome, Supervisor

BOMB_EXPANDED = 256 << 20
# What the endless engine sends at most (it stops there, so that a reader
# without a cap ends too, and the test with it) and what a capped reader may
# have let it send: the caps (4 to 8 MiB) plus what sockets and the
# pass-through buffer on the way.
ENDLESS_STOP = 96 << 20
ENDLESS_BOUND = 40 << 20
# What a check may allocate in all while a bomb arrives: far below the bomb.
PEAK_BOUND = 32 << 20
DEADLINE_S = 1.0
# Only a hang guard: a check that ignores its deadline is caught here.
HANG_GUARD_S = 60.0

METRICS = (
    b"llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\nllamacpp:n_decode_total 7\n"
)


@functools.cache
def bomb() -> bytes:
    """256 MiB of zeros, gzipped twice (``Content-Encoding: gzip, gzip``): about 600 bytes."""
    once = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip stream
    zeros = bytes(1 << 20)
    inner = b"".join(once.compress(zeros) for _ in range(BOMB_EXPANDED >> 20)) + once.flush()
    return gzip.compress(inner, 9)


@dataclass
class Engine:
    """What a scripted engine was asked, and how much it sent."""

    mode: str
    port: int = 0
    accept_encodings: list[bytes] = field(default_factory=list)
    paths: list[bytes] = field(default_factory=list)
    sent: int = 0


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _answer(seen: Engine, path: bytes, w: asyncio.StreamWriter) -> bool:
    """Answer one request as ``seen.mode`` says; False: the connection is done."""
    if seen.mode == "good":
        body = METRICS
        if path.startswith(b"/v1/models"):
            body = b'{"data": [{"id": "tiny"}]}'
        elif path.startswith(b"/slots"):
            body = b'[{"is_processing": false}]'
        elif path.startswith(b"/v1/completions"):
            body = b'{"choices": [{"text": "hi"}]}'
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await w.drain()
        return True
    if seen.mode == "bomb":
        body = bomb()
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-encoding: gzip, gzip\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await w.drain()
        seen.sent += len(body)
        return True
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n")
    if seen.mode == "trickle":
        while True:  # a byte every half second, as long as anyone reads
            w.write(_chunk(b"#"))
            await w.drain()
            seen.sent += 1
            await asyncio.sleep(0.5)
    block = b"# " + b"x" * ((64 << 10) - 3) + b"\n"
    while seen.sent < ENDLESS_STOP:
        w.write(_chunk(block))
        await w.drain()
        seen.sent += len(block)
    w.write(b"0\r\n\r\n")
    await w.drain()
    return False


@asynccontextmanager
async def hostile(mode: str) -> AsyncIterator[Engine]:
    """An engine answering every request as ``mode`` says, on loopback."""
    seen = Engine(mode)
    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while (request := await read_request(reader)) is not None:
                headers = dict(request.headers)
                seen.accept_encodings.append(headers.get(b"accept-encoding", b""))
                seen.paths.append(request.line.split()[1])
                if not await _answer(seen, request.line.split()[1], w):
                    break
        except ConnectionError:
            pass  # the reader left: what a capped reader does
        finally:
            w.close()

    def on_connection(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(serve(reader, w))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    srv = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    seen.port = srv.sockets[0].getsockname()[1]
    try:
        yield seen
    finally:
        srv.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(srv.wait_closed(), 5)


@asynccontextmanager
async def behind_passthrough(mode: str) -> AsyncIterator[tuple[Engine, str]]:
    """A hostile engine behind the node's real pass-through: it and the endpoint to ask."""
    async with hostile(mode) as seen, front(seen.port) as port:
        yield seen, f"http://127.0.0.1:{port}"


Check = Callable[[httpx.AsyncClient, str], Awaitable[object]]


async def _ready(http: httpx.AsyncClient, endpoint: str) -> object:
    return await probe_ready(http, endpoint, KEY, "tiny", ReadyProbe(), DEADLINE_S)


async def _slots(http: httpx.AsyncClient, endpoint: str) -> object:
    return await engine_load(http, endpoint, KEY, "llama.cpp", DEADLINE_S)


async def _vllm_load(http: httpx.AsyncClient, endpoint: str) -> object:
    return await engine_load(http, endpoint, KEY, "vllm", DEADLINE_S)


async def _liveness(http: httpx.AsyncClient, endpoint: str) -> object:
    return await probe_liveness(http, endpoint, KEY, liveness_probe("llama.cpp"), DEADLINE_S)


async def _scrape(http: httpx.AsyncClient, endpoint: str) -> object:
    try:
        return await fetch_metrics(http, endpoint, KEY, DEADLINE_S)
    except (EngineAnswerRefused, httpx.HTTPError) as exc:
        return exc


async def _lost_node_probe(http: httpx.AsyncClient, endpoint: str) -> object:
    return await probe_endpoint(http, endpoint, KEY, DEADLINE_S)


CHECKS: dict[str, Check] = {
    "readiness": _ready,
    "llama.cpp-load": _slots,
    "vllm-load": _vllm_load,
    "liveness": _liveness,
    "router-metrics-scrape": _scrape,
    "control-lost-node-probe": _lost_node_probe,
}
# Checks that read only an answer's start: a long answer is an answer.
READ_FROM_THE_START = {"liveness": Observation(answered=True), "control-lost-node-probe": ""}


def _failed(check: str, got: object) -> bool:
    """Whether ``got`` is ``check``'s clean failure (no answer taken as one)."""
    if check == "readiness":
        return isinstance(got, tuple) and got[0] is None
    if check.endswith("-load"):
        return isinstance(got, tuple) and got[0] is None
    if check == "liveness":
        return isinstance(got, Observation) and not got.answered
    if check == "control-lost-node-probe":
        return isinstance(got, str) and got != ""  # why it did not answer
    return isinstance(got, EngineAnswerRefused)


@pytest.mark.parametrize("check", list(CHECKS))
async def test_a_gzip_bomb_is_refused_unexpanded(check: str) -> None:
    assert len(bomb()) < 1024  # the bomb is what the review measured
    async with behind_passthrough("bomb") as (seen, endpoint), httpx.AsyncClient() as http:
        tracemalloc.start()
        try:
            async with asyncio.timeout(HANG_GUARD_S):
                got = await CHECKS[check](http, endpoint)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert _failed(check, got), got
    assert "Content-Encoding gzip, gzip refused" in str(got)
    assert peak < PEAK_BOUND, f"{peak} bytes allocated: the bomb was expanded"
    # Asked for identity, through the pass-through, every time.
    assert seen.accept_encodings and set(seen.accept_encodings) == {b"identity"}


@pytest.mark.parametrize("check", list(CHECKS))
async def test_a_trickle_ends_at_the_deadline(check: str) -> None:
    async with behind_passthrough("trickle") as (_, endpoint), httpx.AsyncClient() as http:
        async with asyncio.timeout(HANG_GUARD_S):
            got = await CHECKS[check](http, endpoint)
    assert _failed(check, got), got
    assert f"no answer within {DEADLINE_S:g}s" in str(got)


@pytest.mark.parametrize("check", list(CHECKS))
async def test_an_endless_body_is_read_no_further_than_the_cap(check: str) -> None:
    async with behind_passthrough("endless") as (seen, endpoint), httpx.AsyncClient() as http:
        async with asyncio.timeout(HANG_GUARD_S):
            got = await CHECKS[check](http, endpoint)
        # The reader left; the engine's writes stop once the buffers on the way are full.
        sent = seen.sent
    if check in READ_FROM_THE_START:
        assert got == READ_FROM_THE_START[check]
    else:
        assert _failed(check, got), got
        assert "more than" in str(got) and "bytes" in str(got)
    assert sent < ENDLESS_BOUND, f"the engine sent {sent} bytes: read past the cap"


# --- a node's agent watching a hostile engine beside a good one ----------------


class Node:
    """A supervisor of two replicas, each engine behind its pass-through."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self.endpoints = endpoints
        self.stopped: list[str] = []

    def find_running(self, ref: ShardRef) -> RunningShard | None:
        if ref.replica_id in self.stopped:
            return None
        endpoint = self.endpoints[ref.replica_id]
        return RunningShard(ref=ref, pid=4242, port=1, endpoint=endpoint, log_path=Path("x"))

    def plan_of(self, ref: ShardRef) -> ShardRecord:
        return ShardRecord(model="tiny", engine="llama.cpp", serves_http=True)

    def dead_sidecar(self, ref: ShardRef) -> tuple[str, int] | None:
        return None

    def exit_code(self, ref: ShardRef) -> int | None:
        return None

    def stopped_on_request(self, ref: ShardRef) -> bool:
        return False

    def log_tail(self, ref: ShardRef, lines: int) -> list[str]:
        return []

    def trim_log(self, ref: ShardRef) -> bool:
        return False

    def stop(self, ref: ShardRef, grace_s: float) -> StopOutcome:
        self.stopped.append(ref.replica_id)
        return StopOutcome(was_running=True, exit_code=-9)

    def kill_leftovers(self, ref: ShardRef) -> list[int]:
        return []


RULES = LivenessRules(interval_s=0.05, timeout_s=DEADLINE_S, rounds=3, unanswered_s=0, stall_s=0)
BAD, GOOD = ShardRef(replica_id="r-bad"), ShardRef(replica_id="r-good")


@pytest.mark.parametrize("mode", ["bomb", "trickle"])
async def test_the_agent_keeps_watching_its_node_while_one_engine_is_hostile(mode: str) -> None:
    """The hostile engine's rounds fail cleanly until it is found hung and
    stopped; meanwhile its watch heartbeats, and the other replica's watch,
    in the same agent, sees every round answered and is never suspected."""
    beats: dict[str, list[str]] = {"r-bad": [], "r-good": []}
    async with (
        behind_passthrough(mode) as (bad, bad_endpoint),
        behind_passthrough("good") as (good, good_endpoint),
        httpx.AsyncClient() as http,
    ):
        node = Node({"r-bad": bad_endpoint, "r-good": good_endpoint})
        shards = RunningShards(node, lambda _: KEY, http, RULES)

        def bad_gave_up() -> bool:
            # Old code takes the bomb for an answer: never hung. Give up
            # after twice the rounds that find a hostile engine hung.
            return len(bad.paths) > 2 * RULES.rounds

        def good_done() -> bool:
            return bool(node.stopped) and len(good.paths) >= 2

        async with asyncio.timeout(HANG_GUARD_S):
            bad_watch = asyncio.ensure_future(
                shards.watch(
                    WatchShardInput(shard=BAD, poll_interval_s=0.01),
                    beats["r-bad"].append,
                    bad_gave_up,
                )
            )
            with pytest.raises(AgentShutdown):
                await shards.watch(
                    WatchShardInput(shard=GOOD, poll_interval_s=0.01),
                    beats["r-good"].append,
                    lambda: good_done() or bad_watch.done(),
                )
            ended = await bad_watch
    why = "Content-Encoding gzip, gzip refused" if mode == "bomb" else "no answer within 1s"
    assert ended.reason.startswith(ENGINE_HUNG) and why in ended.reason, ended.reason
    assert node.stopped == ["r-bad"]
    # The hostile engine's watch went on heartbeating through its failed rounds.
    for n in (1, 2):
        told = f"running; liveness: {n}/3 unanswered ("
        assert any(b.startswith(told) and why in b for b in beats["r-bad"]), beats["r-bad"]
    # The good replica kept its state: asked, answered, never suspected.
    assert set(beats["r-good"]) == {"running"} and good.paths
    assert set(good.paths) == {b"/metrics"}


# --- the agent's adapter calls (worker_agent/adapter_service.py) --------------


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("bomb", "Content-Encoding gzip, gzip refused"),
        ("trickle", f"no answer within {DEADLINE_S:g}s"),
        ("endless", "more than 4194304 bytes"),
    ],
)
async def test_an_adapter_call_fails_cleanly_on_a_hostile_answer(
    mode: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter_service, "LISTING_DEADLINE_S", DEADLINE_S)
    monkeypatch.setattr(adapter_service, "CHANGE_DEADLINE_S", DEADLINE_S)
    (tmp_path / "sql").mkdir()
    async with behind_passthrough(mode) as (seen, endpoint), httpx.AsyncClient() as http:
        node = cast(Supervisor, Node({"r-bad": endpoint}))
        adapters = AdapterService(node, lambda _: KEY, http, [tmp_path])
        call = AdapterCall(replica_id="r-bad", name="sql", path=str(tmp_path / "sql"))
        tracemalloc.start()
        try:
            async with asyncio.timeout(HANG_GUARD_S):
                # A load given the cap lists what the engine holds first.
                with pytest.raises(AdapterLoadFailed, match="listing its models") as listing:
                    await adapters.load(call.model_copy(update={"max_loaded": 2}))
                if mode != "endless":  # an endless 200 to a change is a 200
                    with pytest.raises(AdapterUnloadFailed) as change:
                        await adapters.unload(call)
                    assert why in str(change.value)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        sent = seen.sent
    assert why in str(listing.value)
    assert peak < PEAK_BOUND and sent < ENDLESS_BOUND
    assert set(seen.accept_encodings) == {b"identity"}


# --- the router's endpoint proof (router/control_link/endpoint_proof.py) -------


async def test_an_endpoint_proof_sent_compressed_proves_nothing() -> None:
    """What answers a proof is untrusted until proven: asked for identity, and
    a compressed answer is never expanded, even one holding the right MAC
    (the real pass-through never compresses)."""
    heads: list[bytes] = []

    async def compressing(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head.lower())
        target = head.split()[1].decode()
        nonce = parse_qs(urlsplit(target).query)[endpoint_proof.NONCE_PARAM][0]
        address = endpoint_proof.endpoint_address(endpoint)
        assert address is not None
        proof = endpoint_proof.answer(KEY, address, nonce)
        body = gzip.compress(json.dumps({"proof": proof}).encode())
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await w.drain()
        w.close()

    srv = await asyncio.start_server(compressing, "127.0.0.1", 0)
    endpoint = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    prover = HttpProver(lambda _: KEY, timeout_s=HANG_GUARD_S)
    try:
        verdict = await prover.prove("r-bad", endpoint)
    finally:
        await prover.aclose()
        srv.close()
    assert verdict is Verdict.WRONG
    assert len(heads) == 1 and b"accept-encoding: identity\r\n" in heads[0]
