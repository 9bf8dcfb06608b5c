"""Activity names, shared by the workflows that call them and the workers that
serve them, so neither has to import the other's code."""

# Control queue
PLACE_REPLICA = "place_replica"
RELEASE_REPLICA = "release_replica"
VALIDATE_REPLICA = "validate_replica"
FLEET_CORDON = "fleet_cordon"
PROBE_ENGINE = "probe_engine"

# Node queues (node-<id>)
FETCH_WEIGHTS = "fetch_weights"
RESERVE_PORT = "reserve_port"
LAUNCH_SHARD = "launch_shard"
WAIT_SHARD_READY = "wait_shard_ready"
WATCH_SHARD = "watch_shard"
STOP_SHARD = "stop_shard"
DRAIN_SHARD = "drain_shard"
SHARD_LOG_TAIL = "shard_log_tail"
SHARD_LOAD = "shard_load"
SHARD_RUNNING = "shard_running"
LOAD_ADAPTER = "load_adapter"
UNLOAD_ADAPTER = "unload_adapter"
