"""Custom search attributes: what the Temporal UI, the CLI and the router filter on.

The dev server registers them at start (``temporal-dev/devserver.py``); a
production cluster needs the same list registered once with
``temporal operator search-attribute create``.
"""

from datetime import datetime

from temporalio.common import SearchAttributeIndexedValueType, SearchAttributeKey

REPLICA_MODEL = SearchAttributeKey.for_keyword("ReplicaModel")
REPLICA_NODE = SearchAttributeKey.for_keyword("ReplicaNode")
REPLICA_STATE = SearchAttributeKey.for_keyword("ReplicaState")
REPLICA_ENDPOINT = SearchAttributeKey.for_keyword("ReplicaEndpoint")
# When the Replica last published its state (workflow time): the router lists
# only the replicas changed since its last listing (router/replica_source.py).
REPLICA_UPDATED_AT = SearchAttributeKey.for_datetime("ReplicaUpdatedAt")

ALL: tuple[SearchAttributeKey[str] | SearchAttributeKey[datetime], ...] = (
    REPLICA_MODEL,
    REPLICA_NODE,
    REPLICA_STATE,
    REPLICA_ENDPOINT,
    REPLICA_UPDATED_AT,
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
