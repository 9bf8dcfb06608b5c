"""Loading and unloading LoRA adapters in this node's running engines.

The agent's side of the adapter activities (``activities/agent/adapters.py``
only adapts these calls to Temporal). They call vLLM's runtime LoRA API from
the node, with the replica's engine key: the engine is reachable without a key
from nowhere but its node, and the paths come from the catalog (the
AdapterLoad workflow's input), never from a client, and must resolve inside
the weights roots (``LLMGW_WEIGHTS_ROOTS``), as weights do: the engine is
handed the resolved path. Repeats are harmless: an adapter already loaded, or
already gone on unload, is reported as no change.

An unload asks the engine first whether the adapter has requests running or
waiting (vLLM's ``vllm:lora_requests_info``): the router that chose it as
idle knows only its own requests, and another router's may be in flight.
Such an unload is refused (``AdapterBusy``) and the router chooses again.

The engine's cap holds whatever the routers believe: a load given the
replica's ``max_loaded`` first lists what the engine holds, and when it is
full (a router's view lagged behind another router's loads) unloads an idle
one itself, the oldest loaded first (none idle: ``AdapterEngineFull``).
Adapter calls to one replica run one at a time on its node, so two loads
cannot both find the last free place.
"""

import asyncio
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import httpx

from llmgw.bounded_http import Answer, fetch
from llmgw.engine_keys import EngineKeyFn
from llmgw.errors import (
    AdapterBusy,
    AdapterEngineFull,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterOutsideRoots,
    AdapterUnloadFailed,
    EngineAnswerRefused,
    EngineGone,
)
from llmgw.types import AdapterCall, AdapterCallResult, ShardRef
from worker_agent.supervisor import RunningShard, Supervisor
from worker_agent.weights import Roots, SourceOutsideRoots

log = logging.getLogger(__name__)

# An engine is an untrusted byte source (llmgw/bounded_http.py): what is read
# of its answers is uncompressed, capped, and whole within a deadline.
# A load reads the adapter from disk before the engine answers.
CHANGE_DEADLINE_S = 300.0
LISTING_DEADLINE_S = 30.0
# A load's or unload's answer: a line of text, its start kept.
_ANSWER_BYTES = 64 << 10
# A model listing or a vLLM /metrics, adapters included.
_LISTING_BYTES = 4 << 20


class AdapterService:
    """Adapter calls to this node's engines; built by the agent."""

    def __init__(
        self,
        supervisor: Supervisor,
        engine_key: EngineKeyFn,
        http: httpx.AsyncClient,
        roots: Sequence[Path],
    ) -> None:
        """``roots``: the only directories adapters may be loaded from."""
        self._sup = supervisor
        self._roots = Roots.of(roots)
        self._engine_key = engine_key
        self._http = http
        self._locks: dict[str, asyncio.Lock] = {}

    def _auth(self, replica_id: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._engine_key(replica_id)}"}

    def _lock(self, replica_id: str) -> asyncio.Lock:
        """One adapter change at a time per replica (check and change together)."""
        return self._locks.setdefault(replica_id, asyncio.Lock())

    def _engine(self, replica_id: str) -> RunningShard:
        running = self._sup.find_running(ShardRef(replica_id=replica_id))
        if running is None:
            raise EngineGone(f"replica {replica_id} has no running engine on this node")
        return running

    async def _post(self, replica_id: str, path: str, body: dict[str, str]) -> Answer:
        """POST a change; an answer refused unread fails it (AdapterLoadFailed or
        AdapterUnloadFailed, retryable: whether it was made is unknown)."""
        engine = self._engine(replica_id)
        try:
            return await fetch(
                self._http, "POST", f"{engine.endpoint}{path}", headers=self._auth(replica_id),
                json_body=body, max_bytes=_ANSWER_BYTES, deadline_s=CHANGE_DEADLINE_S,
                truncate=True,
            )  # fmt: skip
        except EngineAnswerRefused as exc:
            failed = AdapterUnloadFailed if "unload" in path else AdapterLoadFailed
            raise failed(f"{path}: {exc}") from None

    async def _get(self, replica_id: str, path: str) -> Answer:
        engine = self._engine(replica_id)
        return await fetch(
            self._http, "GET", f"{engine.endpoint}{path}", headers=self._auth(replica_id),
            max_bytes=_LISTING_BYTES, deadline_s=LISTING_DEADLINE_S,
        )  # fmt: skip

    async def load(self, call: AdapterCall) -> AdapterCallResult:
        """Load a catalog adapter into the replica's engine.

        Raises:
            AdapterOutsideRoots, AdapterNotFound: the path is refused.
            EngineGone: the replica has no engine on this node.
            AdapterEngineFull: the engine holds its cap and none is idle.
            AdapterLoadFailed: the engine refused or failed the load.
        """
        try:
            # Before looking for it: whether a file outside exists is no one's business.
            path = await asyncio.to_thread(self._roots.inside, call.path)
        except SourceOutsideRoots as exc:
            raise AdapterOutsideRoots(f"adapter {call.name}: {exc}") from None
        if not await asyncio.to_thread(path.exists):
            raise AdapterNotFound(f"adapter {call.name}: {call.path} does not exist on this node")
        async with self._lock(call.replica_id):
            unloaded = await self._make_room(call) if call.max_loaded else []
            resp = await self._post(
                call.replica_id,
                "/v1/load_lora_adapter",
                {"lora_name": call.name, "lora_path": str(path)},
            )
        if resp.status == 200:
            log.info("replica %s: adapter %s loaded", call.replica_id, call.name)
            return AdapterCallResult(changed=True, detail=resp.text()[:200], unloaded=unloaded)
        if resp.status == 400 and "already" in resp.text():
            return AdapterCallResult(changed=False, detail="already loaded", unloaded=unloaded)
        message = _message(resp)
        # 404 (path the engine cannot read) and 500 (rank too high, bad
        # adapter) will not change on a retry; anything else might.
        raise AdapterLoadFailed(
            f"adapter {call.name}: engine answered {resp.status}: {message}",
            retryable=resp.status not in (404, 500),
        )

    async def _loaded(self, replica_id: str) -> list[str]:
        """The adapters the engine holds, in its listing's order (loading order)."""
        try:
            resp = await self._get(replica_id, "/v1/models")
        except EngineAnswerRefused as exc:
            raise AdapterLoadFailed(f"listing its models: {exc}") from None
        if resp.status != 200:
            raise AdapterLoadFailed(
                f"engine answered {resp.status} listing its models: {_message(resp)}"
            )
        try:
            return [str(m["id"]) for m in resp.json()["data"] if m.get("parent")]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise AdapterLoadFailed(f"an unreadable model listing: {exc!r}"[:200]) from None

    async def _make_room(self, call: AdapterCall) -> list[str]:
        """Unload an idle adapter when the engine is full; what was unloaded."""
        loaded = await self._loaded(call.replica_id)
        if call.name in loaded or len(loaded) < call.max_loaded:
            return []
        busy = await self._busy(call.replica_id)
        idle = [n for n in loaded if busy is not None and n not in busy]
        if not idle:
            why = "none of them idle" if busy is not None else "its metrics unreadable"
            # Not AdapterBusy: that tells the router its chosen victim is
            # still loaded, and this refusal comes after that unload.
            raise AdapterEngineFull(
                f"replica {call.replica_id} holds {len(loaded)} adapters (its cap is"
                f" {call.max_loaded}), {why}: {call.name} not loaded"
            )
        await self._unload(call.replica_id, idle[0])
        log.warning(
            "replica %s: full when asked for %s (a router's view lagged): unloaded %s",
            call.replica_id, call.name, idle[0],
        )  # fmt: skip
        return [idle[0]]

    async def _busy(self, replica_id: str) -> set[str] | None:
        """Adapters with requests running or waiting in the engine (None: unknown)."""
        try:
            resp = await self._get(replica_id, "/metrics")
        except (httpx.HTTPError, EngineAnswerRefused) as exc:
            log.warning("replica %s: no metrics to check adapters with: %s", replica_id, exc)
            return None
        return busy_adapters(resp.text()) if resp.status == 200 else None

    async def unload(self, call: AdapterCall) -> AdapterCallResult:
        """Unload an adapter (to make room) unless the engine is serving it;
        unknown to the engine is no change.

        Raises:
            AdapterBusy: it has requests in flight (another router's).
            EngineGone: the replica has no engine on this node.
            AdapterUnloadFailed: the engine failed the unload.
        """
        async with self._lock(call.replica_id):
            busy = await self._busy(call.replica_id)
            if busy is not None and call.name in busy:
                raise AdapterBusy(
                    f"adapter {call.name} has requests in flight on replica {call.replica_id}"
                    " (another router's): not unloaded"
                )
            changed = await self._unload(call.replica_id, call.name)
        return AdapterCallResult(changed=changed, detail="" if changed else "not loaded")

    async def _unload(self, replica_id: str, name: str) -> bool:
        """Unload from the engine; False when it did not hold it."""
        resp = await self._post(replica_id, "/v1/unload_lora_adapter", {"lora_name": name})
        if resp.status == 200:
            log.info("replica %s: adapter %s unloaded", replica_id, name)
            return True
        if resp.status == 404:
            return False
        raise AdapterUnloadFailed(f"unload {name}: engine answered {resp.status}: {_message(resp)}")


def _message(resp: Answer) -> str:
    try:
        return str(resp.json().get("message") or resp.json())[:200]
    except (ValueError, AttributeError):
        return resp.text()[:200]


_LORA_INFO = re.compile(r"^vllm:lora_requests_info\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def busy_adapters(metrics: str) -> set[str]:
    """The adapters vLLM reports running or waiting, from its Prometheus text.

    vLLM sets ``vllm:lora_requests_info`` to the current time under labels
    naming them (comma-separated); label sets it used before stay exposed
    with older times, so the newest sample is the current one.
    """
    newest: tuple[float, dict[str, str]] | None = None
    for match in _LORA_INFO.finditer(metrics):
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if newest is None or value >= newest[0]:
            newest = (value, dict(_LABEL.findall(match["labels"])))
    if newest is None:
        return set()
    labels = newest[1]
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    return {n for n in names.split(",") if n}
