"""Issue 23 item 13: a burst through the pass-through is answered at once by
an engine whose HTTP server holds a thread per kept-alive connection.

llama-server's HTTP server (cpp-httplib) serves each connection on one of its
threads for as long as the connection is kept alive: after an answer the
thread waits for the connection's next request, up to 5 s. More threads are
started only when none is idle at the moment a connection is queued, so a
burst of connections (a wake dispatches every waiting request at once) can
find its threads taken by connections the pass-through keeps idle in its
pool: a request was answered ~5 s late, once in a few wakes
(tests/e2e/test_wake_latency.py). The stand-in engine here has one such
thread, which makes the race certain: the pass-through must not keep idle engine
connections for long."""

import asyncio
import os
import time
from pathlib import Path

from temporalio.testing import ActivityEnvironment

from activities.agent.shards import NodeActivities
from llmgw.engine_keys import engine_key
from llmgw.types import (
    EngineKind,
    LaunchShardInput,
    ModelSpec,
    ShardRef,
    ShardSpec,
    StopShardInput,
)
from llmgw_cli.dev.tinymodel import TinyModel
from tests.agent.test_passthrough import (
    AUTH,
    Client,
    Engine,
    engine,
    front,
    read_request,
    response,
)
from tests.harness import cpu_inventory, free_port, llama_only
from worker_agent import passthrough
from worker_agent.installs.llamacpp import LlamaCppInstall
from worker_agent.launch import Launcher
from worker_agent.shard_service import ShardService
from worker_agent.supervisor import Supervisor

# cpp-httplib's CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND
ENGINE_KEEPALIVE_S = 5.0


def one_thread_engine() -> tuple[asyncio.Semaphore, object]:
    thread = asyncio.Semaphore(1)

    async def serve(seen: Engine, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        # The connection waits for the thread, then keeps it until it closes
        # or stays silent for the keep-alive timeout, as cpp-httplib's does.
        async with thread:
            while True:
                try:
                    async with asyncio.timeout(ENGINE_KEEPALIVE_S):
                        request = await read_request(reader)
                except TimeoutError:
                    return
                if request is None:
                    return
                seen.requests.append(request)
                w.write(response(200, [(b"content-length", b"2")], b"ok"))
                await w.drain()

    return thread, serve


async def test_a_burst_is_not_queued_behind_idle_engine_connections() -> None:
    """In llama.cpp's mode (``close_engine_connections``): in the pooled mode
    vLLM and SGLang get, this takes 4-5 s a burst."""
    _, serve = one_thread_engine()
    async with (
        engine(serve) as seen,  # type: ignore[arg-type]
        front(seen.port, close_engine_connections=True) as port,
    ):
        clients = [await Client.open(port) for _ in range(4)]
        try:
            for _ in range(2):  # the second burst finds what the first left
                began = time.monotonic()
                answers = await asyncio.gather(
                    *(
                        c.exchange(b"POST", b"/v1/completions", [(b"authorization", AUTH)], b"{}")
                        for c in clients
                    )
                )
                took = time.monotonic() - began
                assert [status for status, _, _ in answers] == [200] * 4
                # Each answer takes milliseconds, and an idle pooled connection
                # is closed within a fraction of a second; one queued behind it
                # took the pool's keep-alive (4 s) or the engine's (5 s).
                assert took < 3.0, took
        finally:
            for c in clients:
                await c.close()
    assert len(seen.requests) == 8


async def test_the_engine_plan_says_which_engines_get_a_connection_per_request(
    llama: LlamaCppInstall, tiny: TinyModel, tmp_path: Path
) -> None:
    """llama.cpp's pass-through is started in that mode (its cmdline says so);
    vLLM's and SGLang's keep pooled connections, which spare each request a
    connect (tests/bench/bench_passthrough.py)."""
    sup = Supervisor(tmp_path)
    start = free_port()
    launcher = Launcher(
        supervisor=sup,
        installs=llama_only(llama, tmp_path),
        engine_key=lambda rid: engine_key("test-secret", rid),
        engine_host="127.0.0.1",
        ports=range(start, start + 50),
        inventory=cpu_inventory,
        threads=1,
    )
    acts = NodeActivities(ShardService(launcher))
    for kind in (EngineKind.VLLM, EngineKind.SGLANG):
        model = ModelSpec(name=f"m-{kind.value}", engine=kind, source="org/model")
        async with launcher.planned(ShardSpec(replica_id=f"r-{kind.value}", model=model)) as plan:
            assert plan.close_engine_connections is False, kind
    model = ModelSpec(name="tiny-close", engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    ref = ShardRef(replica_id="close-1")
    env = ActivityEnvironment()
    handle = await env.run(
        acts.launch_shard, LaunchShardInput(spec=ShardSpec(replica_id=ref.replica_id, model=model))
    )
    try:
        # The pass-through leads the shard's process group.
        cmdline = Path(f"/proc/{os.getpgid(handle.pid)}/cmdline").read_bytes().replace(b"\0", b" ")
        assert b"worker_agent.passthrough" in cmdline, cmdline
        assert passthrough.CLOSE_FLAG.encode() in cmdline, cmdline
    finally:
        await env.run(acts.stop_shard, StopShardInput(shard=ref, grace_s=5))
        await acts.aclose()
