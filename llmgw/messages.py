"""Names of the workflows and of their signals, updates and queries.

Shared by every sender (CLI, reconcile, router, agent, other workflows) and
the workflow that receives them, so neither side retypes the other's
string. Activity names are in ``activities/names.py``.

The values are part of stored workflow histories and of running workflows
on upgraded clusters: never change one (tests/control/test_replay.py replays them).
"""

# Workflow types
FLEET = "Fleet"
REPLICA = "Replica"
DEPLOYMENT = "Deployment"
RENDEZVOUS = "Rendezvous"
DRAIN_NODE = "DrainNode"
ADAPTER_LOAD = "AdapterLoad"
SHARD_LOGS = "ShardLogs"

# Fleet: signals from the agents, updates and a query from control and CLI
REGISTER_NODE = "register_node"
DEREGISTER_NODE = "deregister_node"
PLACE = "place"
PLACE_BATCH = "place_batch"
RELEASE = "release"
CORDON = "cordon"
SNAPSHOT = "snapshot"
NODES = "nodes"

# Replica
STOP = "stop"
REQUEST_STOP = "request_stop"
ADAPTERS_CHANGED = "adapters_changed"

# Deployment: signals from its replicas, updates from the CLI and reconcile
REPLICA_READY = "replica_ready"
REPLICA_ENDED = "replica_ended"
SCALE = "scale"
SET_MODEL = "set_model"
ROLLING_RESTART = "rolling_restart"

# Replica and Deployment both answer it with their state.
STATUS = "status"

# Deployment, elastic serving: load from the routers, a wake from a router
# holding requests for a model at zero, and the autoscale bounds.
REPORT_LOAD = "report_load"
WAKE = "wake"
SET_AUTOSCALE = "set_autoscale"
