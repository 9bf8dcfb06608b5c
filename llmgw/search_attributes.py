"""Custom search attributes: what the Temporal UI, the CLI and the router filter on.

The dev server registers them at start (``temporal-dev/devserver.py``); a
production cluster needs the same list registered once with
``temporal operator search-attribute create``.
"""

import logging
from datetime import datetime

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeIndexedValueType, SearchAttributeKey
from temporalio.service import RPCError

from llmgw.errors import ConfigError

log = logging.getLogger(__name__)

REPLICA_MODEL = SearchAttributeKey.for_keyword("ReplicaModel")
REPLICA_NODE = SearchAttributeKey.for_keyword("ReplicaNode")
REPLICA_STATE = SearchAttributeKey.for_keyword("ReplicaState")
REPLICA_ENDPOINT = SearchAttributeKey.for_keyword("ReplicaEndpoint")
# When the Replica last published its state (workflow time): the router lists
# only the replicas changed since its last listing (router/control_link/replica_source.py).
REPLICA_UPDATED_AT = SearchAttributeKey.for_datetime("ReplicaUpdatedAt")
# Durable jobs' status (workflows/jobs_batch.py, jobs_response.py): the UI
# filters batches and background responses by it; progress is in the memo.
BATCH_STATUS = SearchAttributeKey.for_keyword("BatchStatus")
RESPONSE_STATUS = SearchAttributeKey.for_keyword("ResponseStatus")

ALL: tuple[SearchAttributeKey[str] | SearchAttributeKey[datetime], ...] = (
    REPLICA_MODEL,
    REPLICA_NODE,
    REPLICA_STATE,
    REPLICA_ENDPOINT,
    REPLICA_UPDATED_AT,
    BATCH_STATUS,
    RESPONSE_STATUS,
)

# The names ``temporal server start-dev --search-attribute`` and
# ``temporal operator search-attribute create --type`` take.
_CLI_TYPE = {
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
    SearchAttributeIndexedValueType.DATETIME: "Datetime",
}


def cli_flags() -> list[str]:
    """``--search-attribute Name=Type`` flags for ``temporal server start-dev``."""
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}={_CLI_TYPE[key.indexed_value_type]}"]
    return flags


async def require_registered(client: Client) -> None:
    """Raise ConfigError naming each attribute the client's namespace lacks.

    A workflow that upserts an unregistered attribute fails its workflow task
    over and over (stuck, not failed), so the control worker checks first.
    A server that will not list them (no permission) is not a reason to stop.
    """
    request = ListSearchAttributesRequest(namespace=client.namespace)
    try:
        found = await client.operator_service.list_search_attributes(request)
    except RPCError as exc:
        log.warning("cannot list Temporal search attributes (%s): not checked", exc.message)
        return
    have = dict(found.custom_attributes)
    missing = [k for k in ALL if have.get(k.name) != k.indexed_value_type.value]
    if missing:
        commands = "; ".join(
            f"temporal operator search-attribute create --namespace {client.namespace}"
            f" --name {k.name} --type {_CLI_TYPE[k.indexed_value_type]}"
            for k in missing
        )
        names = ", ".join(k.name for k in missing)
        raise ConfigError(
            f"Temporal namespace {client.namespace!r} lacks search attributes {names}"
            f" (or has them with another type); register them: {commands}"
        )
