"""The invariants of a randomized run, read from the real system: Temporal
(the deployment and the fleet's ledger), each host's processes, the store.

After every heal the counts must come back exact: the desired ready
replicas, one engine per replica and none without one, an allocation per
replica and none without one. At the end: usage billed exactly once for
every request the client saw succeed, and every batch line present once.
"""

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import replicas
from llmgw.types import ReplicaPhase
from tests.cluster.scenario import engine_groups
from tests.cluster.stack import MODEL, Cluster
from worker_agent.supervisor import TITLE_ENV
from workflows.placement import split_live

TITLE = f"{TITLE_ENV}=".encode()


def engines_by_replica(cluster: Cluster, nodes: list[str]) -> Counter[tuple[str, str]]:
    """Engine process groups running on ``nodes``, by (node, replica id)."""
    return Counter(
        {
            (node, rid): len(groups)
            for node, found in engine_groups(cluster, nodes).items()
            for rid, groups in found.items()
        }
    )


@dataclass
class Exact:
    """What the counts were the last time they were read, and what was wrong."""

    ok: bool
    problems: list[str]


async def exact_now(cluster: Cluster, client: Client, nodes: list[str], desired: int) -> Exact:
    """Whether every count is exact right now; what is not."""
    problems: list[str] = []
    status = await replicas.deployment_status(client, MODEL)
    live_slots = [s for s in status.slots if s.replica_id and not s.next_start_at]
    placed: dict[str, str] = {}
    for slot in live_slots:
        memo = await replicas.replica_memo(client, slot.replica_id)
        if memo is None or memo.phase is not ReplicaPhase.READY:
            problems.append(f"replica {slot.replica_id} is {memo.phase if memo else 'unknown'}")
        placed[slot.replica_id] = slot.node_id
    if status.desired != desired or len(status.slots) != desired or len(live_slots) != desired:
        problems.append(
            f"desired {status.desired}/{desired}, slots {len(status.slots)}, live {len(live_slots)}"
        )
    fleet = await replicas.fleet_snapshot(client)
    up, down = split_live(fleet, datetime.now(UTC))
    if not set(nodes) <= set(up):
        problems.append(f"nodes not live: {[r.node_id for r in down]}")
    allocated = set(fleet.allocations)
    if allocated != set(placed):
        problems.append(
            f"ledger: allocations without a replica {sorted(allocated - set(placed))},"
            f" replicas without one {sorted(set(placed) - allocated)}"
        )
    engines = engines_by_replica(cluster, nodes)
    wanted = Counter({(node, rid): 1 for rid, node in placed.items()})
    if engines != wanted:
        extra = sorted((engines - wanted).elements())
        missing = sorted((wanted - engines).elements())
        problems.append(f"engines: extra {extra}, missing {missing}")
    return Exact(not problems, problems)


async def converge(
    cluster: Cluster, client: Client, nodes: list[str], desired: int, bound_s: float
) -> tuple[float | None, list[str]]:
    """Seconds until the counts are exact (None past ``bound_s``), and what was
    still wrong at the bound."""
    began = time.monotonic()
    last: list[str] = ["never read"]
    while time.monotonic() - began < bound_s:
        try:
            exact = await exact_now(cluster, client, nodes, desired)
        except (RPCError, TimeoutError) as exc:
            last = [f"Temporal: {exc}"]
        else:
            if exact.ok:
                return time.monotonic() - began, []
            last = exact.problems
        await asyncio.sleep(0.5)
    return None, last


def usage_of(cluster: Cluster, key_id: int) -> tuple[int, int, int]:
    """(requests, errors, completion tokens) the store holds for the key, all days."""
    with psycopg.connect(
        host=cluster.pg.address,
        port=5432,
        user="llmgw",
        password=cluster.pg.password,
        dbname="llmgw",
        connect_timeout=10,
    ) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(requests), 0), coalesce(sum(errors), 0),"
            " coalesce(sum(completion_tokens), 0) FROM usagedaily WHERE key_id = %s",
            (key_id,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])
