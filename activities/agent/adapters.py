"""Node activities that load and unload LoRA adapters in a running engine.

Only the Temporal layer: the agent's adapter service
(``worker_agent/adapter_service.py``) checks the paths against the weights
roots, keeps the engine's cap and calls vLLM's runtime LoRA API; its refusals
(``AdapterError``s and ``EngineGone``) become the ``ApplicationError`` types the
AdapterLoad workflow and the routers match (``llmgw/error_types.py``).
"""

from temporalio import activity

from llmgw import contracts
from llmgw.errors import AdapterError, EngineGone
from llmgw.types import AdapterCall, AdapterCallResult
from worker_agent.adapter_service import AdapterService


class AdapterActivities:
    """Adapter calls to this node's engines, over the agent's adapter service."""

    def __init__(self, adapters: AdapterService) -> None:
        self._adapters = adapters

    @activity.defn(name=contracts.LOAD_ADAPTER.name)
    async def load_adapter(self, call: AdapterCall) -> AdapterCallResult:
        """Load a catalog adapter into the replica's engine."""
        try:
            return await self._adapters.load(call)
        except (AdapterError, EngineGone) as err:
            raise err.to_application_error() from None

    @activity.defn(name=contracts.UNLOAD_ADAPTER.name)
    async def unload_adapter(self, call: AdapterCall) -> AdapterCallResult:
        """Unload an adapter (to make room) unless the engine is serving it;
        unknown to the engine is no change."""
        try:
            return await self._adapters.unload(call)
        except (AdapterError, EngineGone) as err:
            raise err.to_application_error() from None
