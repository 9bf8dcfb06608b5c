"""The endpoint proof (issue 23 item 5): the router routes to an endpoint only
once it proved, over a nonce, that it holds the replica's engine key.

The prover against the real pass-through served by uvicorn on loopback (and
against a relay, a liar and a mute in its place), then the proven source's
caching, retries and re-proofs with a scripted prover.
"""

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvicorn
from temporalio.client import Client

from llmgw import endpoint_proof, messages
from llmgw.keys import engine_key
from llmgw.queues import replica_workflow_id
from llmgw.types import ReplicaMemo, ReplicaPhase
from router.endpoint_proof import HttpProver, ProvenSource
from router.replica_source import TemporalReplicaSource
from router.routing import RoutingTable, refresh_forever
from worker_agent.passthrough import PassThrough

SECRET = "proof-test-secret"
RID = "r-proof"


def key_of(replica_id: str) -> str:
    return engine_key(SECRET, replica_id)


@asynccontextmanager
async def passthrough(key: str, listen_port: int | None = None) -> AsyncIterator[int]:
    """A pass-through holding ``key`` on loopback (its upstream goes nowhere:
    a proof never reaches the engine); yields its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    listen = endpoint_proof.address("127.0.0.1", listen_port or port)
    app = PassThrough("http://127.0.0.1:9", key, listen=listen)
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        sock.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def tcp(handler: Handler) -> AsyncIterator[int]:
    """A TCP server on loopback running ``handler`` per connection; yields its port.
    Every connection is closed when it ends."""
    writers: list[asyncio.StreamWriter] = []

    async def on_connection(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        writers.append(w)
        await handler(r, w)

    srv = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        for w in writers:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        srv.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(srv.wait_closed(), 5)


@asynccontextmanager
async def relay(target_port: int) -> AsyncIterator[int]:
    """A forged endpoint that forwards every byte to the real pass-through and back."""

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def on_connection(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    async with tcp(on_connection) as port:
        yield port


async def test_the_real_pass_through_proves_its_own_replica_only() -> None:
    prover = HttpProver(key_of)
    async with passthrough(key_of(RID)) as port:
        endpoint = f"http://127.0.0.1:{port}"
        assert await prover.prove(RID, endpoint)
        assert not await prover.prove("another-replica", endpoint)
        # No key needed, and a bad nonce is refused.
        async with asyncio.timeout(10):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(
                f"GET {endpoint_proof.PROOF_PATH}?nonce=xyz HTTP/1.1\r\nHost: h\r\n\r\n".encode()
            )
            assert (await r.readline()).startswith(b"HTTP/1.1 400")
            w.close()
            await w.wait_closed()


async def test_a_relay_to_the_real_pass_through_proves_nothing() -> None:
    prover = HttpProver(key_of)
    async with passthrough(key_of(RID)) as port, relay(port) as forged:
        assert await prover.prove(RID, f"http://127.0.0.1:{port}")
        assert not await prover.prove(RID, f"http://127.0.0.1:{forged}")


async def test_a_pass_through_told_another_address_proves_nothing() -> None:
    async with passthrough(key_of(RID), listen_port=1) as port:
        assert not await HttpProver(key_of).prove(RID, f"http://127.0.0.1:{port}")


async def test_liars_and_mutes_prove_nothing_and_see_no_key() -> None:
    seen: list[bytes] = []

    async def liar(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(await r.readuntil(b"\r\n\r\n"))
        body = b'{"proof": "' + b"0" * 64 + b'"}'
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await w.drain()
        w.close()

    async def mute(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(await r.readuntil(b"\r\n\r\n"))
        await r.read()  # never answers: the prover's timeout closes the connection

    prover = HttpProver(key_of, timeout_s=0.5)
    async with tcp(liar) as lying, tcp(mute) as silent:
        assert not await prover.prove(RID, f"http://127.0.0.1:{lying}")
        assert not await prover.prove(RID, f"http://127.0.0.1:{silent}")
    assert not await prover.prove(RID, "https://127.0.0.1:1")  # only what we can bind to
    assert len(seen) == 2
    for head in seen:
        assert head.startswith(b"GET " + endpoint_proof.PROOF_PATH.encode() + b"?nonce=")
        assert b"authorization" not in head.lower() and key_of(RID).encode() not in head


class ScriptedProver:
    """Answers as told, per endpoint; counts the proofs asked."""

    def __init__(self) -> None:
        self.answers: dict[str, bool] = {}
        self.asked: list[tuple[str, str]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def prove(self, replica_id: str, endpoint: str) -> bool:
        self.asked.append((replica_id, endpoint))
        await self.gate.wait()
        return self.answers.get(endpoint, False)


class ListSource:
    def __init__(self, memos: list[ReplicaMemo]) -> None:
        self.memos = memos

    async def replicas(self) -> list[ReplicaMemo]:
        return self.memos


def memo(rid: str, endpoint: str, phase: ReplicaPhase = ReplicaPhase.READY) -> ReplicaMemo:
    return ReplicaMemo(replica_id=rid, model="m", phase=phase, endpoint=endpoint, node_id="n")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_unproven_endpoint_is_left_out_until_its_proof_lands() -> None:
    good, forged = memo("a", "http://h:1"), memo("b", "http://h:2")
    starting = memo("c", "http://h:3", ReplicaPhase.STARTING)
    bare = memo("d", "", ReplicaPhase.READY)
    prover = ScriptedProver()
    prover.answers["http://h:1"] = True
    prover.gate.clear()
    source = ProvenSource(ListSource([good, forged, starting, bare]), prover, first_wait_s=0)
    changed: list[int] = []
    source.on_change(lambda: changed.append(1))
    # Proofs under way: nothing with an endpoint in a routable phase yet.
    assert await source.replicas() == [starting, bare]
    await settle()
    assert sorted(prover.asked) == [("a", "http://h:1"), ("b", "http://h:2")]
    generation = source.generation
    prover.gate.set()
    await settle()
    assert changed == [1]  # the table is told to refresh now
    assert await source.replicas() == [good, starting, bare]
    assert source.generation == generation + 1
    # Cached: no proof asked again, the same list, the same generation.
    assert await source.replicas() == [good, starting, bare]
    assert len(prover.asked) == 2 and source.generation == generation + 1


async def test_a_starting_routers_first_table_waits_for_the_first_proofs() -> None:
    prover = ScriptedProver()
    prover.answers["http://h:1"] = True
    good, mute = memo("a", "http://h:1"), memo("b", "http://h:2")
    never = asyncio.Event()

    class Muted(ScriptedProver):
        async def prove(self, replica_id: str, endpoint: str) -> bool:
            if endpoint == "http://h:2":
                await never.wait()  # a forged endpoint that never answers
            return await prover.prove(replica_id, endpoint)

    source = ProvenSource(ListSource([good, mute]), Muted(), first_wait_s=0.5)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await source.replicas() == [good]
    assert 0.4 < loop.time() - began < 5  # the mute held it back for the bound only
    began = loop.time()
    assert await source.replicas() == [good]  # later listings wait for nothing
    assert loop.time() - began < 0.2


async def test_failed_proofs_are_retried_with_backoff_and_proofs_are_made_again() -> None:
    now = [0.0]
    prover = ScriptedProver()
    listed = ListSource([memo("a", "http://h:1")])
    source = ProvenSource(listed, prover, lambda: now[0], reprove_s=60, retry_s=1, retry_max_s=4)
    assert await source.replicas() == []
    await settle()
    for step, wait in enumerate([0.5, 0.6, 1.9, 0.2, 4.0, 4.0]):
        now[0] += wait
        await source.replicas()
        await settle()
        assert len(prover.asked) == [1, 2, 2, 3, 4, 5][step], step  # backoff 1, 2, 4, 4
    prover.answers["http://h:1"] = True
    now[0] += 4.0
    await source.replicas()
    await settle()
    assert await source.replicas() == listed.memos
    asked = len(prover.asked)
    now[0] += 59
    assert await source.replicas() == listed.memos
    await settle()
    assert len(prover.asked) == asked
    # The port changed hands: the re-proof fails and the replica leaves.
    prover.answers["http://h:1"] = False
    now[0] += 2
    await source.replicas()
    await settle()
    assert len(prover.asked) == asked + 1
    assert await source.replicas() == []


async def test_a_new_endpoint_for_the_same_replica_is_proven_anew_and_the_old_forgotten() -> None:
    prover = ScriptedProver()
    prover.answers["http://h:1"] = True
    listed = ListSource([memo("a", "http://h:1")])
    source = ProvenSource(listed, prover)
    await source.replicas()
    await settle()
    assert source.proven("a", "http://h:1")
    listed.memos = [memo("a", "http://h:2")]
    assert await source.replicas() == []
    await settle()
    assert not source.proven("a", "http://h:1") and not source.proven("a", "http://h:2")
    assert prover.asked[-1] == ("a", "http://h:2")


async def test_the_routing_table_gets_a_proven_replica_without_waiting_an_interval() -> None:
    prover = ScriptedProver()
    prover.answers["http://h:1"] = True
    prover.gate.clear()
    source = ProvenSource(ListSource([memo("a", "http://h:1")]), prover, first_wait_s=0)
    table, ready = RoutingTable(), asyncio.Event()
    task = asyncio.create_task(refresh_forever(table, source, dict, 3600, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        assert table.candidates("m") == []
        prover.gate.set()
        async with asyncio.timeout(10):  # an hour's interval: only on_change can do it
            while not table.candidates("m"):
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("endpoint", ["http://h", "ftp://h:1", "http://:1", "http://h:x"])
def test_only_http_host_port_endpoints_have_an_address(endpoint: str) -> None:
    assert endpoint_proof.endpoint_address(endpoint) is None
    assert endpoint_proof.endpoint_address("http://[::1]:8/") == "::1:8"


async def test_a_memo_naming_another_replica_than_its_workflow_is_ignored(client: Client) -> None:
    """A running workflow id is unique, a memo is not: a twin of a replica
    (its id under another workflow) must not stand beside it."""
    rid = f"twin-{uuid.uuid4().hex[:8]}"
    own = ReplicaMemo(replica_id=rid, model="m-twin", phase=ReplicaPhase.READY)
    handles = [
        await client.start_workflow(
            messages.REPLICA,
            id=replica_workflow_id(wid),
            task_queue=f"nobody-{wid}",  # no worker: it just sits there, running
            memo={"replica": own.model_dump(mode="json")},
        )
        for wid in (rid, f"{rid}-twin")
    ]
    source = TemporalReplicaSource(client)
    try:
        query = f'WorkflowId STARTS_WITH "{replica_workflow_id(rid)}"'
        async with asyncio.timeout(30):  # visibility lags the starts a little
            while len([w async for w in client.list_workflows(query)]) < 2:
                await asyncio.sleep(0.1)
        assert [m for m in await source.replicas() if m.replica_id == rid] == [own]
    finally:
        for handle in handles:
            await handle.terminate("test over")
