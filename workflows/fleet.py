"""The fleet: one entity workflow holding node inventory and the GPU ledger.

Placement is an update, so allocations are serialised by the workflow and a
GPU is never handed out twice; agents register by signal-with-start.
"""

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw import contracts
    from llmgw.types import (
        CordonInput,
        FleetSnapshot,
        NodeInventory,
        NodeLiveness,
        NodeRef,
        NodesQuery,
        NodesResult,
        PlaceBatch,
        PlaceBatchResult,
        Placement,
        PlaceRequest,
        PlaceResult,
        PreemptionRecord,
        Rejection,
        ReleaseRequest,
        ReleaseResult,
    )
    from workflows.ledger import rebuild_from_report
    from workflows.placement import choose_node, split_live
    from workflows.placement_index import PlacementIndex
    from workflows.preemption import claims, plan_preemption, reserved_key

# Preemption records kept in the fleet's state (older ones are in the history).
KEEP_PREEMPTIONS = 50
MULTI_NODE_PREEMPTION = "multi-node-preemption-v1"
NODES_MEMO_PATCH = "fleet-nodes-memo-v1"


@workflow.defn(name=contracts.FLEET.name)
class FleetWorkflow:
    """Node inventory and allocation ledger; continues as new when long."""

    @workflow.init
    def __init__(self, snapshot: FleetSnapshot) -> None:
        # Signals delivered with the start run before run(): state must exist here.
        self._state = snapshot
        self._published_nodes: dict[str, str] | None = None
        # Derived from the ledger (never stored, rebuilt when in doubt): it
        # chooses what choose_node would, without scoring every node.
        self._index: PlacementIndex | None = None

    @workflow.run
    async def run(self, snapshot: FleetSnapshot) -> FleetSnapshot:
        """Wait until history is long, then carry the state into a new run."""
        self._publish_nodes()
        await workflow.wait_condition(lambda: workflow.info().is_continue_as_new_suggested())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._state)

    @workflow.signal(name=contracts.REGISTER_NODE.name)
    def register_node(self, inventory: NodeInventory) -> None:
        """An agent (re)registered: replace its inventory."""
        first = inventory.node_id not in self._state.liveness
        self._state.nodes[inventory.node_id] = inventory
        self._state.liveness[inventory.node_id] = NodeLiveness(last_seen=workflow.now().isoformat())
        if self._state.lost.pop(inventory.node_id, None) is not None:
            workflow.logger.info("node %s is back (its agent registered)", inventory.node_id)
        self._publish_nodes()
        added = rebuild_from_report(self._state.allocations, inventory)
        if self._index is not None:
            self._index.set_node(inventory)
        if added:
            self._index = None  # the ledger grew behind the index's back
            workflow.logger.warning(
                "node %s runs shards the ledger lacked, now recorded: %s",
                inventory.node_id, ", ".join(added),
            )  # fmt: skip
        if first:
            workflow.logger.info(
                "node %s registered: %d GPUs", inventory.node_id, len(inventory.gpus)
            )

    def _indexed(self) -> PlacementIndex:
        if self._index is None:
            state = self._state
            self._index = PlacementIndex(state.nodes, claims(state.allocations, state.reservations))
        return self._index

    def _publish_nodes(self) -> None:
        """Registered nodes' engine addresses as memo, when they changed."""
        nodes = {n.node_id: n.address for n in self._state.nodes.values()}
        if nodes == self._published_nodes or not workflow.patched(NODES_MEMO_PATCH):
            return
        self._published_nodes = nodes
        # Routers send requests (and engine keys) only to these addresses,
        # so a forged Replica memo cannot point them elsewhere.
        workflow.upsert_memo(contracts.FLEET_NODES_MEMO.encode(contracts.FleetNodes(nodes)))

    @workflow.signal(name=contracts.DEREGISTER_NODE.name)
    def deregister_node(self, node: NodeRef) -> None:
        """An agent shut down cleanly: offer its node to no new replica."""
        seen = self._state.liveness.get(node.node_id)
        if seen is not None:
            seen.up = False
            workflow.logger.info("node %s deregistered", node.node_id)

    @workflow.update(name=contracts.PLACE.name)
    def place(self, request: PlaceRequest) -> PlaceResult:
        """Choose a node and record the allocation (idempotent per replica).

        When nothing fits, room held by lower-priority replicas is reserved
        for this one and the answer names them: the caller drains them.
        """
        return self._place(request, split_live(self._state, workflow.now()))

    @workflow.update(name=contracts.PLACE_BATCH.name)
    def place_batch(self, batch: PlaceBatch) -> PlaceBatchResult:
        """``place`` for each request in turn, in one workflow task."""
        # Liveness is judged once: workflow time stands still within a task.
        live = split_live(self._state, workflow.now())
        return PlaceBatchResult(results=[self._place(r, live) for r in batch.requests])

    def _place(
        self, request: PlaceRequest, live_down: tuple[dict[str, NodeInventory], list[Rejection]]
    ) -> PlaceResult:
        state = self._state
        rid = request.replica_id
        reserved = state.reservations.get(rid)
        if reserved is not None:
            waiting = [v for v in reserved.victims if v in state.allocations]
            if waiting:
                reason = f"waiting for preempted {', '.join(waiting)} to stop"
                node = reserved.placement.node_id
                return PlaceResult(
                    rejections=[Rejection(node_id=node, reason=reason)], preempt=waiting
                )
            del state.reservations[rid]
            state.allocations[rid] = reserved.placement
            index = self._indexed()
            index.remove(reserved_key(rid))
            index.add(rid, reserved.placement)
            return PlaceResult(placement=reserved.placement)
        existing = state.allocations.get(rid)
        if existing is not None:
            return PlaceResult(placement=existing)
        live, down = live_down
        placement = self._indexed().choose(rid, request.model, {r.node_id for r in down})
        if placement is not None:
            # The reasons other nodes were passed over are left out: computing
            # them costs what placement on a large fleet otherwise would not.
            self._allocate(rid, placement)
            return PlaceResult(placement=placement)
        # Nothing fits: the full scorer says why, node by node.
        result = choose_node(
            rid, request.model, live, claims(state.allocations, state.reservations)
        )
        if result.placement is not None:  # never, unless the index disagrees
            workflow.logger.error("placement index missed a fit for %s", rid)
            self._allocate(rid, result.placement)
            return result
        result.rejections += down
        # Histories from before multi-node preemption replay with its old
        # rule; asking only for multi-node models keeps every other history
        # free of the marker.
        multi_node = request.model.profile.nodes > 1 and workflow.patched(MULTI_NODE_PREEMPTION)
        plan = plan_preemption(
            rid, request.model, live, state.allocations, state.reservations, multi_node=multi_node
        )
        if plan is not None:
            state.reservations[rid] = plan
            self._indexed().add(reserved_key(rid), plan.placement)
            result.preempt = plan.victims
            self._record_preemption(request, plan.victims)
        return result

    def _allocate(self, replica_id: str, placement: Placement) -> None:
        self._state.allocations[replica_id] = placement
        self._indexed().add(replica_id, placement)

    def _record_preemption(self, request: PlaceRequest, victims: list[str]) -> None:
        now = workflow.now().isoformat()
        for victim in victims:
            node_id = self._state.allocations[victim].node_id
            record = PreemptionRecord(
                at=now,
                preemptor=request.replica_id,
                preemptor_priority=request.model.priority,
                victim=victim,
                victim_priority=self._state.allocations[victim].priority,
                node_id=node_id,
            )
            self._state.preemptions.append(record)
            workflow.logger.warning(
                "replica %s (priority %d) preempts %s (priority %d) on %s",
                record.preemptor, record.preemptor_priority, victim, record.victim_priority,
                node_id,
            )  # fmt: skip
        del self._state.preemptions[:-KEEP_PREEMPTIONS]

    @workflow.update(name=contracts.RELEASE.name)
    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Give back a replica's allocation (and any room reserved for it)."""
        rid = request.replica_id
        if request.node_lost:
            # The replica's evidence (agent silent, engine unreachable) comes
            # before the fleet's own silence bound: a replacement placed there
            # would wait out its schedule-to-start, and fail, again and again.
            self._state.lost[request.node_lost] = workflow.now().isoformat()
            workflow.logger.warning(
                "node %s found lost by replica %s: offered to none until it registers",
                request.node_lost, rid,
            )  # fmt: skip
        self._state.reservations.pop(rid, None)
        released = self._state.allocations.pop(rid, None) is not None
        if self._index is not None:
            self._index.remove(reserved_key(rid))
            self._index.remove(rid)
        return ReleaseResult(released=released)

    @workflow.update(name=contracts.CORDON.name)
    def cordon(self, request: CordonInput) -> FleetSnapshot:
        """Cordon (or uncordon) a node: running replicas stay, new ones go elsewhere."""
        cordoned = set(self._state.cordoned)
        if request.cordoned:
            cordoned.add(request.node_id)
        else:
            cordoned.discard(request.node_id)
        self._state.cordoned = sorted(cordoned)
        return self._state

    @workflow.query(name=contracts.NODES.name)
    def nodes(self, query: NodesQuery) -> NodesResult:
        """Some nodes' inventories: what checking a launch needs, without
        serialising the whole fleet (megabytes on a large one) each time."""
        known = self._state.nodes
        return NodesResult(nodes={n: known[n] for n in query.node_ids if n in known})

    @workflow.query(name=contracts.SNAPSHOT.name)
    def snapshot(self) -> FleetSnapshot:
        """The whole fleet state."""
        return self._state
