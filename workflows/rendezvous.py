"""Rendezvous: start every rank of a multi-node replica, in the right order.

One workflow per multi-node start (id ``rendezvous/<replica_id>``) so a
hang is visible and timed: the whole start is bounded, and on failure or
cancellation every rank already started is stopped before the error goes up
(the parent then releases the GPUs).

Order matters, and differs by engine: vLLM and SGLang put the rendezvous
point on rank 0, so the leader starts first and workers wait for its port;
llama.cpp's RPC leader connects to its workers while loading, so workers
start first and the leader waits for theirs.
"""

import asyncio
import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.errors import RendezvousFailed
    from llmgw.types import (
        EngineKind,
        LaunchShardInput,
        ModelSpec,
        PortReservation,
        Rendezvous,
        RendezvousInput,
        RendezvousResult,
        ShardHandle,
        ShardPlacement,
        ShardRef,
        ShardSpec,
        ValidateInput,
        WaitReadyInput,
    )
    from workflows.calls import failure_reason, fetch_input, node_activity, stop_rank


def start_order(engine: EngineKind, nodes: int) -> list[int]:
    """Ranks in the order they must start."""
    workers = list(range(1, nodes))
    return [*workers, 0] if engine is EngineKind.LLAMA_CPP else [0, *workers]


def needs_weights(engine: EngineKind, rank: int) -> bool:
    """Whether a rank reads the weights itself (llama.cpp RPC workers do not)."""
    return rank == 0 or engine is not EngineKind.LLAMA_CPP


@workflow.defn(name=contracts.RENDEZVOUS.name)
class RendezvousWorkflow:
    """Starts the ranks of one multi-node replica; compensates on failure."""

    @workflow.run
    async def run(self, request: RendezvousInput) -> RendezvousResult:
        """Every rank started and the leader ready, or nothing left running."""
        self._req = request
        self._t = request.timeouts
        try:
            return await self._bounded()
        except (ActivityError, TimeoutError, ApplicationError) as err:
            await self._stop_all()
            raise RendezvousFailed(
                f"multi-node start failed: {_why(err, self._t.rendezvous_s)}"
            ).to_application_error() from err
        except asyncio.CancelledError:
            await self._stop_all()
            raise

    async def _bounded(self) -> RendezvousResult:
        """The start, or TimeoutError once the bound passes (whatever the
        cancelled activity in flight then raises)."""
        start = asyncio.ensure_future(self._start())
        timer = asyncio.ensure_future(asyncio.sleep(self._t.rendezvous_s))
        await workflow.wait([start, timer], return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            timer.cancel()
            return start.result()
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, ActivityError, ApplicationError):
            await start
        raise TimeoutError(f"rendezvous not complete within {self._t.rendezvous_s:.0f}s")

    async def _start(self) -> RendezvousResult:
        shards = {s.rank: s for s in self._req.placement.shards()}
        engine = self._req.model.engine
        models = {
            rank: await self._weights(shard) if needs_weights(engine, rank) else self._req.model
            for rank, shard in shards.items()
        }
        rendezvous = await self._rendezvous(engine, shards)
        await contracts.VALIDATE_REPLICA.run(
            ValidateInput(
                model=self._req.model, placement=self._req.placement, rendezvous=rendezvous
            ),
            start_to_close_timeout=timedelta(seconds=30),
        )
        handles: dict[int, ShardHandle] = {}
        for rank in start_order(engine, len(shards)):
            shard = shards[rank]
            spec = ShardSpec(
                replica_id=self._req.replica_id,
                rank=rank,
                model=models[rank],
                gpu_indices=shard.gpu_indices,
                rendezvous=rendezvous,
                port=self._ports.get(rank),
                catalog_digest=self._req.model.digest(),
            )
            handles[rank] = await node_activity(
                shard.node_id,
                contracts.LAUNCH_SHARD,
                LaunchShardInput(spec=spec),
                self._t,
                timedelta(seconds=self._t.rendezvous_s),
            )
            workflow.logger.info(
                "replica %s rank %d started on %s", self._req.replica_id, rank, shard.node_id
            )
        for rank in sorted(handles, reverse=True):  # workers alive, then the leader answering
            await node_activity(
                shards[rank].node_id,
                contracts.WAIT_SHARD_READY,
                WaitReadyInput(shard=self._ref(rank), timeout_s=self._t.ready_s),
                self._t,
                timedelta(seconds=self._t.ready_s + 30),
            )
        return RendezvousResult(leader=handles[0], ranks=[handles[r] for r in sorted(handles)])

    async def _weights(self, shard: ShardPlacement) -> ModelSpec:
        model = self._req.model
        fetched = await node_activity(
            shard.node_id,
            contracts.FETCH_WEIGHTS,
            fetch_input(self._req.replica_id, model),
            self._t,
            timedelta(seconds=self._t.fetch_s),
        )
        return model.model_copy(update={"source": fetched.path})

    async def _rendezvous(
        self, engine: EngineKind, shards: dict[int, ShardPlacement]
    ) -> Rendezvous:
        """Reserve the ports peers must know before anything starts."""
        self._ports: dict[int, int] = {}
        reserve = [r for r in shards if r > 0] if engine is EngineKind.LLAMA_CPP else [0]
        found: dict[int, PortReservation] = {}
        for rank in reserve:
            found[rank] = await node_activity(
                shards[rank].node_id,
                contracts.RESERVE_PORT,
                self._ref(rank),
                self._t,
                timedelta(seconds=30),
            )
            self._ports[rank] = found[rank].port
        if engine is EngineKind.LLAMA_CPP:
            workers = tuple(f"{found[r].host}:{found[r].port}" for r in sorted(found))
            return Rendezvous(rpc_workers=workers, timeout_s=self._t.rendezvous_s)
        leader = found[0]
        # The leader's HTTP port is its own pick; the reserved one is for the
        # engines' own rendezvous (vLLM --master-port, SGLang --dist-init-addr,
        # or the Ray head).
        self._ports.pop(0)
        if engine is EngineKind.VLLM and self._req.model.profile.launch_mode == "ray":
            # On Ray the head's GCS port is the meeting point; vLLM's Ray
            # executor opens its own torch port on the head, so no master port.
            return Rendezvous(
                leader_address=leader.host, ray_port=leader.port, timeout_s=self._t.rendezvous_s
            )
        return Rendezvous(
            leader_address=leader.host, leader_port=leader.port, timeout_s=self._t.rendezvous_s
        )

    async def _stop_all(self) -> None:
        for shard in self._req.placement.shards():
            try:
                await stop_rank(shard.node_id, self._ref(shard.rank), self._t)
            except ActivityError as err:
                workflow.logger.warning("could not stop rank %d: %s", shard.rank, err)

    def _ref(self, rank: int) -> ShardRef:
        return ShardRef(replica_id=self._req.replica_id, rank=rank)


def _why(err: BaseException, bound_s: float) -> str:
    if isinstance(err, TimeoutError):
        return f"not complete within {bound_s:.0f}s"
    return failure_reason(err)
