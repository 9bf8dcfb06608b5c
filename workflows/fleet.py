"""The fleet: one entity workflow holding node inventory and the GPU ledger.

Placement is an update, so allocations are serialised by the workflow and a
GPU is never handed out twice; agents register by signal-with-start.
"""

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmgw.types import (
        CordonInput,
        FleetSnapshot,
        NodeInventory,
        NodeLiveness,
        NodeRef,
        PlaceRequest,
        PlaceResult,
        ReleaseRequest,
        ReleaseResult,
    )
    from workflows.placement import choose_node, split_live


@workflow.defn(name="Fleet")
class FleetWorkflow:
    """Node inventory and allocation ledger; continues as new when long."""

    @workflow.init
    def __init__(self, snapshot: FleetSnapshot) -> None:
        # Signals delivered with the start run before run(): state must exist here.
        self._state = snapshot

    @workflow.run
    async def run(self, snapshot: FleetSnapshot) -> FleetSnapshot:
        """Wait until history is long, then carry the state into a new run."""
        await workflow.wait_condition(lambda: workflow.info().is_continue_as_new_suggested())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._state)

    @workflow.signal(name="register_node")
    def register_node(self, inventory: NodeInventory) -> None:
        """An agent (re)registered: replace its inventory."""
        first = inventory.node_id not in self._state.liveness
        self._state.nodes[inventory.node_id] = inventory
        self._state.liveness[inventory.node_id] = NodeLiveness(last_seen=workflow.now().isoformat())
        if first:
            workflow.logger.info(
                "node %s registered: %d GPUs", inventory.node_id, len(inventory.gpus)
            )

    @workflow.signal(name="deregister_node")
    def deregister_node(self, node: NodeRef) -> None:
        """An agent shut down cleanly: offer its node to no new replica."""
        seen = self._state.liveness.get(node.node_id)
        if seen is not None:
            seen.up = False
            workflow.logger.info("node %s deregistered", node.node_id)

    @workflow.update(name="place")
    def place(self, request: PlaceRequest) -> PlaceResult:
        """Choose a node and record the allocation (idempotent per replica)."""
        live, down = split_live(self._state, workflow.now())
        result = choose_node(request.replica_id, request.model, live, self._state.allocations)
        if result.placement is None:
            result.rejections += down
        else:
            self._state.allocations[request.replica_id] = result.placement
        return result

    @workflow.update(name="release")
    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Give back a replica's allocation."""
        released = self._state.allocations.pop(request.replica_id, None) is not None
        return ReleaseResult(released=released)

    @workflow.update(name="cordon")
    def cordon(self, request: CordonInput) -> FleetSnapshot:
        """Cordon (or uncordon) a node: running replicas stay, new ones go elsewhere."""
        cordoned = set(self._state.cordoned)
        if request.cordoned:
            cordoned.add(request.node_id)
        else:
            cordoned.discard(request.node_id)
        self._state.cordoned = sorted(cordoned)
        return self._state

    @workflow.query(name="snapshot")
    def snapshot(self) -> FleetSnapshot:
        """The whole fleet state."""
        return self._state
