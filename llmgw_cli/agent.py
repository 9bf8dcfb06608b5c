"""``llmgw agent``: the node agent, with the Temporal activities over its services.

Put together here, above both, so the imports between them point one way:
``activities/agent/`` adapts the agent's services (``worker_agent/``) to
Temporal and imports them; the agent takes the activities it serves from
``serving`` and never imports that layer.
"""

from collections.abc import Callable

from activities.agent.adapters import AdapterActivities
from activities.agent.shards import NodeActivities
from worker_agent.main import AgentServices
from worker_agent.main import main as run_agent


def serving(services: AgentServices) -> list[Callable[..., object]]:
    """Every activity the agent serves on ``node-<id>``."""
    shards = NodeActivities(services.shards)
    adapters = AdapterActivities(services.adapters)
    return [
        shards.fetch_weights,
        shards.reserve_port,
        shards.launch_shard,
        shards.wait_shard_ready,
        shards.watch_shard,
        shards.drain_shard,
        shards.shard_load,
        shards.shard_running,
        shards.stop_shard,
        shards.shard_log_tail,
        adapters.load_adapter,
        adapters.unload_adapter,
    ]


def main() -> None:
    """Run the node agent until SIGTERM/SIGINT."""
    run_agent(serving)
