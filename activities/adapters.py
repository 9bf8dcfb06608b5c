"""Node activities that load and unload LoRA adapters in a running engine.

They call vLLM's runtime LoRA API from the node, with the replica's engine
key: the engine is reachable without a key from nowhere but its node, and the
paths come from the catalog (the AdapterLoad workflow's input), never from a
client. Repeats are harmless: an adapter already loaded, or already gone on
unload, is reported as no change.
"""

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import names
from llmgw.types import AdapterCall, AdapterCallResult, ShardRef
from worker_agent.supervisor import RunningShard, Supervisor

log = logging.getLogger(__name__)


class AdapterActivities:
    """Adapter calls to this node's engines; built by the agent."""

    def __init__(
        self, supervisor: Supervisor, engine_key: Callable[[str], str], http: httpx.AsyncClient
    ) -> None:
        self._sup = supervisor
        self._engine_key = engine_key
        self._http = http

    def _engine(self, replica_id: str) -> RunningShard:
        running = self._sup.find_running(ShardRef(replica_id=replica_id))
        if running is None:
            raise ApplicationError(
                f"replica {replica_id} has no running engine on this node",
                type="EngineGone",
                non_retryable=True,
            )
        return running

    async def _post(self, replica_id: str, path: str, body: dict[str, str]) -> httpx.Response:
        engine = self._engine(replica_id)
        headers = {"Authorization": f"Bearer {self._engine_key(replica_id)}"}
        return await self._http.post(f"{engine.endpoint}{path}", json=body, headers=headers)

    @activity.defn(name=names.LOAD_ADAPTER)
    async def load_adapter(self, call: AdapterCall) -> AdapterCallResult:
        """Load a catalog adapter into the replica's engine."""
        if not await asyncio.to_thread(Path(call.path).exists):
            raise ApplicationError(
                f"adapter {call.name}: {call.path} does not exist on this node",
                type="AdapterNotFound",
                non_retryable=True,
            )
        resp = await self._post(
            call.replica_id,
            "/v1/load_lora_adapter",
            {"lora_name": call.name, "lora_path": call.path},
        )
        if resp.status_code == 200:
            log.info("replica %s: adapter %s loaded", call.replica_id, call.name)
            return AdapterCallResult(changed=True, detail=resp.text[:200])
        if resp.status_code == 400 and "already" in resp.text:
            return AdapterCallResult(changed=False, detail="already loaded")
        message = _message(resp)
        # 404 (path the engine cannot read) and 500 (rank too high, bad
        # adapter) will not change on a retry; anything else might.
        raise ApplicationError(
            f"adapter {call.name}: engine answered {resp.status_code}: {message}",
            type="AdapterLoadFailed",
            non_retryable=resp.status_code in (404, 500),
        )

    @activity.defn(name=names.UNLOAD_ADAPTER)
    async def unload_adapter(self, call: AdapterCall) -> AdapterCallResult:
        """Unload an adapter (to make room); unknown to the engine is no change."""
        resp = await self._post(
            call.replica_id, "/v1/unload_lora_adapter", {"lora_name": call.name}
        )
        if resp.status_code == 200:
            log.info("replica %s: adapter %s unloaded", call.replica_id, call.name)
            return AdapterCallResult(changed=True)
        if resp.status_code == 404:
            return AdapterCallResult(changed=False, detail="not loaded")
        raise ApplicationError(
            f"unload {call.name}: engine answered {resp.status_code}: {_message(resp)}",
            type="AdapterUnloadFailed",
        )


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message") or resp.json())
    except ValueError:
        return resp.text[:200]
