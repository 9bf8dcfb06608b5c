"""A CLI command against a Temporal server that takes the connection and
does not answer (frozen: SIGSTOP, a stalled host) waits for it, saying so,
and carries on once it answers; it fails only after LLMGW_TEMPORAL_WAIT_S.
Found by issue 36 scenario 6: ``llmgw scale`` in a 60 s freeze failed after
30 s with the SDK's "Timeout expired", for an outage about to end."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from llmgw_cli.common import CliSettings, connect


class FrozenFront:
    """A TCP front for a server: connections are taken but nothing reaches
    the server (nor comes back) until :meth:`thaw`, as with a frozen process
    whose listening socket the kernel still serves."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.rsplit(":", 1)
        self.port = int(port)
        self.thawed = asyncio.Event()
        self._pipes: set[asyncio.Task[None]] = set()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.thawed.wait()
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        for pipe in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()
            for task in list(self._pipes):
                task.cancel()


@pytest.mark.timeout(180)
async def test_a_command_waits_out_a_frozen_server(
    temporal_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    front = FrozenFront(temporal_address)
    async with front.running() as address:
        settings = CliSettings(temporal_address=address, temporal_wait_s=150)
        connecting = asyncio.create_task(connect(settings))
        # One try gives up after the SDK's 30 s; the command says it waits on.
        async with asyncio.timeout(120):
            while "is not answering" not in capsys.readouterr().err:
                if connecting.done():
                    connecting.result()  # before the fix: TemporalConnectError
                    pytest.fail("connected while frozen")
                await asyncio.sleep(0.2)
        front.thawed.set()
        async with asyncio.timeout(60):
            client = await connecting
        info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
        assert info.server_version
