"""The router's replica source: Replica workflows' memos, read off Temporal's
visibility store, a full listing now and then and only the changes between.

Every Replica publishes its phase as memo and search attributes, and stamps
``ReplicaUpdatedAt`` (workflow time) on each publish. At 10,000 replicas a full
listing is ten 1,000-workflow pages, ~190 ms of router CPU; a delta listing
asks only for the replicas that published, started or closed since the last
listing began (less a margin), a page or less. A full listing still runs
every ``full_resync_s`` (anything a delta could miss: a workflow deleted
while running, a visibility write later than the margin), after any failed
listing, and on every refresh while a running Replica lacks
``ReplicaUpdatedAt`` (its workflow code predates it, so its phase changes
would not show in a delta).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.api.workflow.v1 import WorkflowExecutionInfo
from temporalio.api.workflowservice.v1 import (
    DescribeWorkflowExecutionRequest,
    ListWorkflowExecutionsRequest,
)
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import contracts
from llmgw import search_attributes as sa
from llmgw.queues import FLEET_WORKFLOW_ID, replica_workflow_id
from llmgw.types import ReplicaMemo
from router.control_link.routing import on_registered_nodes

log = logging.getLogger(__name__)

# Bounded: a slow Temporal delays a refresh, never a request.
LIST_RPC_TIMEOUT = timedelta(seconds=5)
LIST_QUERY = f'WorkflowType="{contracts.REPLICA.name}" AND ExecutionStatus="Running"'
# The visibility store's usual page cap: ten list calls for 10,000 replicas.
LIST_PAGE_SIZE = 1000
# How far before the previous listing's start a delta looks back: visibility
# is eventually consistent (a publish may be indexed a moment after it
# happened) and ReplicaUpdatedAt is the server's clock, not the router's.
DELTA_MARGIN_S = 30.0
DEFAULT_FULL_RESYNC_S = 300.0
_RUNNING = WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING


def delta_since(
    now: float,
    last_full: float | None,
    last_listing: float | None,
    full_resync_s: float,
    legacy: bool,
    margin_s: float = DELTA_MARGIN_S,
) -> float | None:
    """The next listing's lower bound (epoch seconds), or None for a full one.

    ``last_full``/``last_listing``: when the last full and the last listing of
    either kind began, None when there was none since a failure; ``legacy``:
    the last full listing found a running replica without ``ReplicaUpdatedAt``.
    """
    if last_full is None or last_listing is None or legacy:
        return None
    if now - last_full >= full_resync_s:
        return None
    return last_listing - margin_s


def rfc3339(epoch_s: float) -> str:
    """``epoch_s`` as the visibility query language's Datetime literal (UTC)."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def delta_query(since: float) -> str:
    """Replica workflows that published, started or closed at ``since`` or later,
    whatever their status: a closed one leaves the table; one started by older
    code (no ``ReplicaUpdatedAt``) is listed through its start and turns full
    listings back on."""
    t = rfc3339(since)
    return (
        f'WorkflowType="{contracts.REPLICA.name}" AND ({sa.REPLICA_UPDATED_AT.name} >= "{t}"'
        f' OR StartTime >= "{t}" OR CloseTime >= "{t}")'
    )


@dataclass(frozen=True, slots=True)
class _Entry:
    run_id: str
    raw: bytes  # the memo payload as last listed
    memo: ReplicaMemo | None  # None: malformed (not decoded again while unchanged)
    ok: bool  # its endpoint is on its registered node (and it is well formed)


class TemporalReplicaSource:
    """Reads replica memos off visibility listings, and the Fleet's registered
    nodes off its memo (a describe: no worker needed).

    Built for thousands of replicas refreshed every second on the router's own
    event loop: the list is read page by page through the raw service API (the
    SDK's list would build a full execution object, search attributes decoded,
    for every workflow), a memo is decoded only when its bytes differ from the
    last listing's, the registered-node check reruns only for changed memos or
    changed nodes, and the loop gets a turn between pages. When nothing changed,
    :meth:`replicas` returns the very same list and :attr:`generation` stays.
    Between full listings (module docstring) only the changes are listed.
    """

    def __init__(
        self,
        client: Client,
        page_size: int = LIST_PAGE_SIZE,
        full_resync_s: float = DEFAULT_FULL_RESYNC_S,
        clock: Callable[[], float] = time.time,
        make_delta_query: Callable[[float], str] = delta_query,
    ) -> None:
        self._client = client
        self._page_size = page_size
        self._full_resync_s = full_resync_s
        self._clock = clock
        self._make_delta_query = make_delta_query
        self._nodes: dict[str, str] = {}
        self._nodes_raw = b""
        self._entries: dict[str, _Entry] = {}  # workflow id -> its running replica
        self._kept: list[ReplicaMemo] = []
        self._warned: set[str] = set()
        self._last_full: float | None = None
        self._last_listing: float | None = None
        self._legacy = False
        self._recheck = False
        self.generation = 0
        # The last listing's lower bound; None when it was a full one.
        self.last_since: float | None = None

    async def replicas(self) -> list[ReplicaMemo]:
        """Every running replica workflow's published state, less foreign endpoints.

        Raises when a listing fails; the next one is then a full listing.
        """
        started = self._clock()
        since = delta_since(
            started, self._last_full, self._last_listing, self._full_resync_s, self._legacy
        )
        self._last_listing = None  # until this listing succeeds
        # Changed nodes are checked against every entry once a listing succeeds.
        self._recheck |= await self._refresh_nodes()
        if since is None:
            entries, changed, legacy = await self._full()
            self._last_full = started
        else:
            entries, changed, legacy = await self._delta(since)
        if self._recheck:
            entries = {wid: self._checked(e) for wid, e in entries.items()}
        if changed or self._recheck:
            self._kept = [e.memo for e in entries.values() if e.ok and e.memo is not None]
            self.generation += 1
        self._entries, self._legacy, self._recheck = entries, legacy, False
        self._last_listing, self.last_since = started, since
        return self._kept

    async def _full(self) -> tuple[dict[str, _Entry], bool, bool]:
        """Every running replica; whether that changed anything, whether one
        lacks ReplicaUpdatedAt."""
        entries: dict[str, _Entry] = {}
        changed = legacy = False
        async for page in self._pages(LIST_QUERY):
            fresh, old = await self._absorb(page, entries)
            changed, legacy = changed or fresh, legacy or old
        return entries, changed or entries.keys() != self._entries.keys(), legacy

    async def _delta(self, since: float) -> tuple[dict[str, _Entry], bool, bool]:
        """The last entries, updated by what was listed since ``since``."""
        entries = dict(self._entries)
        changed = legacy = False
        async for page in self._pages(self._make_delta_query(since)):
            running: list[WorkflowExecutionInfo] = []
            for info in page:
                if info.status == _RUNNING:
                    running.append(info)
                    continue
                wid = info.execution.workflow_id
                entry = entries.get(wid)
                # A later run under the same id may be the one listed as running.
                if entry is not None and entry.run_id == info.execution.run_id:
                    del entries[wid]
                    changed = True
            fresh, old = await self._absorb(running, entries)
            changed, legacy = changed or fresh, legacy or old
        return entries, changed, legacy

    async def _absorb(
        self, page: Sequence[WorkflowExecutionInfo], entries: dict[str, _Entry]
    ) -> tuple[bool, bool]:
        """Put the running replicas of ``page`` in ``entries``, decoding only
        changed memos; whether a memo changed, whether one lacks ReplicaUpdatedAt."""
        legacy = False
        fresh: list[tuple[str, str, bytes, Payload]] = []
        for info in page:
            if info.type.name != contracts.REPLICA.name:  # the query says so; so does this
                continue
            legacy |= sa.REPLICA_UPDATED_AT.name not in info.search_attributes.indexed_fields
            payload = info.memo.fields.get(contracts.REPLICA_MEMO.key)
            if payload is None:
                continue
            wid, run_id = info.execution.workflow_id, info.execution.run_id
            raw = payload.SerializeToString()
            prev = self._entries.get(wid)
            if prev is not None and prev.raw == raw:
                entries[wid] = prev if prev.run_id == run_id else replace(prev, run_id=run_id)
            else:
                fresh.append((wid, run_id, raw, payload))
        if fresh:
            values = await self._decode([p for *_, p in fresh])
            for (wid, run_id, raw, _), value in zip(fresh, values, strict=True):
                memo = self._parse(wid, value)
                entries[wid] = self._checked(_Entry(run_id, raw, memo, ok=False))
        await asyncio.sleep(0)  # requests get the loop between pages
        return bool(fresh), legacy

    async def _pages(self, query: str) -> AsyncIterator[Sequence[WorkflowExecutionInfo]]:
        token = b""
        while True:
            request = ListWorkflowExecutionsRequest(
                namespace=self._client.namespace,
                page_size=self._page_size,
                next_page_token=token,
                query=query,
            )
            response = await self._client.workflow_service.list_workflow_executions(
                request, retry=True, timeout=LIST_RPC_TIMEOUT
            )
            yield response.executions
            token = response.next_page_token
            if not token:
                return

    async def _decode(self, payloads: list[Payload]) -> list[object]:
        """Memo payloads as values, through the client's converter (so a payload
        codec would apply); one that cannot be decoded is None, not a failed refresh."""
        try:
            return await self._client.data_converter.decode(payloads)
        except Exception:  # one bad payload among many: find it, keep the rest
            values: list[object] = []
            for payload in payloads:
                try:
                    values += await self._client.data_converter.decode([payload])
                except Exception:  # whatever a forged payload makes it raise
                    values.append(None)
            return values

    def _parse(self, workflow_id: str, value: object) -> ReplicaMemo | None:
        """A listed memo as a :class:`ReplicaMemo`; a malformed one is skipped
        (anyone who can start a workflow can write one) rather than failing
        every replica's refresh."""
        try:
            memo = contracts.REPLICA_MEMO.parse(value)
        except ValidationError as exc:
            if workflow_id not in self._warned:
                self._warned.add(workflow_id)
                log.warning("workflow %s ignored: malformed replica memo: %s", workflow_id, exc)
            return None
        if memo is None:
            return None
        # A running workflow id is unique: a memo naming a replica other than
        # its own workflow's would stand beside that replica's real one.
        if replica_workflow_id(memo.replica_id) != workflow_id:
            if workflow_id not in self._warned:
                self._warned.add(workflow_id)
                log.warning(
                    "workflow %s ignored: its memo names replica %s", workflow_id, memo.replica_id
                )
            return None
        return memo

    def _checked(self, entry: _Entry) -> _Entry:
        """``entry`` with ``ok`` set by the registered-node check."""
        if entry.memo is None:
            return entry
        kept, foreign = on_registered_nodes([entry.memo], self._nodes)
        for stray in foreign:
            if stray.replica_id not in self._warned:
                self._warned.add(stray.replica_id)
                log.warning(
                    "replica %s ignored: endpoint %s is not on registered node %r",
                    stray.replica_id, stray.endpoint, stray.node_id,
                )  # fmt: skip
        ok = bool(kept)
        return entry if entry.ok == ok else replace(entry, ok=ok)

    async def _refresh_nodes(self) -> bool:
        """Read the Fleet's nodes; whether they changed. On failure the last
        known ones stay."""
        request = DescribeWorkflowExecutionRequest(
            namespace=self._client.namespace,
            execution=WorkflowExecution(workflow_id=FLEET_WORKFLOW_ID),
        )
        try:
            desc = await self._client.workflow_service.describe_workflow_execution(
                request, retry=True, timeout=LIST_RPC_TIMEOUT
            )
        except RPCError as exc:
            log.info("fleet nodes not read: %s", exc)
            return False
        payload = desc.workflow_execution_info.memo.fields.get(contracts.FLEET_NODES_MEMO.key)
        raw = payload.SerializeToString() if payload is not None else b""
        if raw == self._nodes_raw:
            return False
        self._nodes_raw = raw
        value = (await self._client.data_converter.decode([payload]))[0] if payload else None
        try:
            parsed = contracts.FLEET_NODES_MEMO.parse(value)
        except ValidationError as exc:
            log.warning("fleet nodes memo ignored: malformed: %s", exc)
            parsed = None
        nodes = parsed.root if parsed is not None else {}
        if nodes == self._nodes:
            return False
        self._nodes = nodes
        return True
