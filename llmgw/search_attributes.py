"""Custom search attributes: what the Temporal UI, the CLI and the router filter on.

The dev server registers them at start (``temporal-dev/devserver.py``); a
production cluster needs the same list registered once with
``temporal operator search-attribute create``.
"""

from temporalio.common import SearchAttributeKey

REPLICA_MODEL = SearchAttributeKey.for_keyword("ReplicaModel")
REPLICA_NODE = SearchAttributeKey.for_keyword("ReplicaNode")
REPLICA_STATE = SearchAttributeKey.for_keyword("ReplicaState")
REPLICA_ENDPOINT = SearchAttributeKey.for_keyword("ReplicaEndpoint")

ALL: tuple[SearchAttributeKey[str], ...] = (
    REPLICA_MODEL,
    REPLICA_NODE,
    REPLICA_STATE,
    REPLICA_ENDPOINT,
)


def cli_flags() -> list[str]:
    """``--search-attribute Name=Keyword`` flags for ``temporal server start-dev``."""
    flags: list[str] = []
    for key in ALL:
        flags += ["--search-attribute", f"{key.name}=Keyword"]
    return flags
