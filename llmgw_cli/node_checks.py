"""``llmgw model apply``'s check of a catalog's sources against the live
agents: what they would refuse, refused before anything is written rather
than at a replica's start (engine_args were checked with the file:
``catalog_problems``)."""

import asyncio
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from llmgw import replicas
from llmgw_cli.common import CliSettings, connect

if TYPE_CHECKING:
    from llmgw.catalog import CatalogModel
    from llmgw.catalog_sources import SourceCheck

# A catalog can be applied before any agent or Temporal runs: the fleet is
# asked within this bound, and then only the notes say what was not checked.
FLEET_TIMEOUT_S = 10.0


async def node_checks(settings: CliSettings, entries: "list[CatalogModel]") -> "SourceCheck":
    """Problems with ``entries``' sources on the live nodes, and notes."""
    from llmgw.catalog_sources import SourceCheck, check_sources  # noqa: PLC0415
    from workflows.placement import split_live  # noqa: PLC0415

    try:
        async with asyncio.timeout(FLEET_TIMEOUT_S):
            fleet = await replicas.fleet_snapshot(await connect(settings, patient=False))
    except Exception as exc:  # any failure only means "not checked"
        why = str(exc) or type(exc).__name__
        return SourceCheck(notes=[f"sources not checked against the nodes: {why}"])
    now = datetime.now(UTC)
    live, _ = split_live(fleet, now)
    ages = {
        node: (now - datetime.fromisoformat(seen.last_seen)).total_seconds()
        for node, seen in fleet.liveness.items()
    }
    return check_sources(entries, live, ages_s=ages)
