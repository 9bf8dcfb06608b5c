"""Superseded by :mod:`llmgw.contracts`; kept only until the agent and its
tests (worker_agent/main.py, tests outside tests/control) send through the
descriptors. The values come from the descriptors: there is one source."""

from llmgw import contracts as _c

FLEET = _c.FLEET.name
REPLICA = _c.REPLICA.name
DEPLOYMENT = _c.DEPLOYMENT.name
RENDEZVOUS = _c.RENDEZVOUS.name
DRAIN_NODE = _c.DRAIN_NODE.name
ADAPTER_LOAD = _c.ADAPTER_LOAD.name
SHARD_LOGS = _c.SHARD_LOGS.name
REGISTER_NODE = _c.REGISTER_NODE.name
DEREGISTER_NODE = _c.DEREGISTER_NODE.name
REPORT_LOAD = _c.REPORT_LOAD.name
WAKE = _c.WAKE.name
