"""Superseded by :mod:`llmgw.contracts`; kept only until activities/agent/
registers its handlers through the descriptors. The values come from the
descriptors: there is one source."""

from llmgw import contracts as _c

FETCH_WEIGHTS = _c.FETCH_WEIGHTS.name
RESERVE_PORT = _c.RESERVE_PORT.name
LAUNCH_SHARD = _c.LAUNCH_SHARD.name
WAIT_SHARD_READY = _c.WAIT_SHARD_READY.name
WATCH_SHARD = _c.WATCH_SHARD.name
STOP_SHARD = _c.STOP_SHARD.name
DRAIN_SHARD = _c.DRAIN_SHARD.name
SHARD_LOG_TAIL = _c.SHARD_LOG_TAIL.name
SHARD_LOAD = _c.SHARD_LOAD.name
SHARD_RUNNING = _c.SHARD_RUNNING.name
LOAD_ADAPTER = _c.LOAD_ADAPTER.name
UNLOAD_ADAPTER = _c.UNLOAD_ADAPTER.name
