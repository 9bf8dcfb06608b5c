"""The strings that cross processes keep their values.

Stored histories, running workflows and older clients carry them: a renamed
constant is fine, a changed value is not.
"""

from llmgw import messages

WIRE_MESSAGES = {
    "FLEET": "Fleet",
    "REPLICA": "Replica",
    "DEPLOYMENT": "Deployment",
    "RENDEZVOUS": "Rendezvous",
    "DRAIN_NODE": "DrainNode",
    "ADAPTER_LOAD": "AdapterLoad",
    "SHARD_LOGS": "ShardLogs",
    "REGISTER_NODE": "register_node",
    "DEREGISTER_NODE": "deregister_node",
    "PLACE": "place",
    "RELEASE": "release",
    "CORDON": "cordon",
    "SNAPSHOT": "snapshot",
    "STOP": "stop",
    "REQUEST_STOP": "request_stop",
    "ADAPTERS_CHANGED": "adapters_changed",
    "REPLICA_READY": "replica_ready",
    "REPLICA_ENDED": "replica_ended",
    "SCALE": "scale",
    "SET_MODEL": "set_model",
    "ROLLING_RESTART": "rolling_restart",
    "STATUS": "status",
}


def _constants(module: object) -> dict[str, str]:
    return {k: v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}


def test_message_names_keep_their_values() -> None:
    assert _constants(messages) == WIRE_MESSAGES
