"""The admin API (``/admin/...``), under its own credential.

Every call needs ``Authorization: Bearer <admin key>``: the router's
``LLMGW_ADMIN_KEY``, or a stored key made with ``llmgw keys create --admin``.
Client keys are refused here, and admin keys are refused by ``/v1``.

Replica states come from the routing table (refreshed from Temporal in the
background), so listing them never waits on Temporal; nodes and log tails
ask Temporal (bounded) and answer 503 when it cannot. Store calls are
bounded the same way (``LLMGW_STORE_WAIT_S``): past it the answer is 503
``store_unavailable``, and a write given up on may still land when the
store answers again (read it back to know).
"""

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import replicas
from llmgw.catalog import CatalogModel
from llmgw.errors import ConfigError, LlmgwError, StoreError
from llmgw.store.catalog_store import (
    apply_entries,
    delete_entry,
    get_entry,
    list_entries,
    scale_model,
)
from llmgw.types import DeploymentStatus, ReplicaMemo
from router.api import apikeys
from router.api.apikeys import KeyInfo, KeyName, KeyUpdate
from router.api.deps import Deps, get_deps
from router.api.openapi_docs import error_responses
from router.billing import usage
from router.billing.key_policy import KeyPolicy
from router.billing.usage import UsageRow
from router.common.blocking import within
from router.common.errors import ErrorKind, invalid_body, invalid_fields
from router.common.incidents import Incident

DepsDep = Annotated[Deps, Depends(get_deps)]
P = ParamSpec("P")
T = TypeVar("T")
# Store integers are 32-bit on PostgreSQL: larger ones are refused up front.
INT32_MAX = 2**31 - 1
KeyId = Annotated[int, Path(ge=1, le=INT32_MAX)]
# The operation's own error answers (openapi_docs.truthful adds 400 for an
# invalid input, and the 401 and 503 of the credential check, to every one).
NO_MODEL = error_responses({404: "No such catalog entry (`not_found`)"})
NO_KEY = error_responses({404: "No such key (`not_found`)"})
NO_REPLICA = error_responses({404: "No such running replica (`not_found`)"})
TEMPORAL = {
    503: "Temporal did not answer (`temporal`), this router has no Temporal client,"
    " or the store did not answer in time (`store_unavailable`, `Retry-After`)"
}


async def _admin(
    deps: DepsDep, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> None:
    await deps.keys.verify_admin(authorization)


router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(_admin)])


def _temporal(deps: Deps) -> Client:
    if deps.temporal is None:
        raise ErrorKind.NO_TEMPORAL_CLIENT.error()
    return deps.temporal


async def _stored(deps: Deps, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn`` on the store, within the router's bound (503 past it)."""
    try:
        return await within(deps.store_wait_s, lambda: fn(*args, **kwargs))
    except StoreError as exc:
        raise ErrorKind.STORE_UNAVAILABLE.error() from exc


# Models -----------------------------------------------------------------


@router.get("/models")
async def admin_list_models(deps: DepsDep) -> list[CatalogModel]:
    """The catalog."""
    return await _stored(deps, list_entries, deps.store)


@router.get("/models/{name}", responses=NO_MODEL)
async def admin_get_model(name: str, deps: DepsDep) -> CatalogModel:
    """One catalog entry."""
    entry = await _stored(deps, get_entry, deps.store, name)
    if entry is None:
        raise ErrorKind.NOT_FOUND.error(what="model", name=name)
    return entry


@router.put(
    "/models/{name}",
    responses=error_responses(
        {
            400: "An invalid field (`param` names it), an entry the catalog refuses,"
            " or a body whose `name` is not the path's (`param`: `name`)"
        }
    ),
)
async def admin_put_model(
    name: Annotated[str, Path(description="The entry's name: the body's `name` must be the same")],
    entry: CatalogModel,
    request: Request,
    deps: DepsDep,
) -> CatalogModel:
    """Add or replace a catalog entry (the catalog file's fields; errors name the field).
    The body's `name` must equal the path's: a body naming another entry is refused
    (400, `param` `name`), so a PUT never renames an entry."""
    try:
        # Read again as JSON, strictly: FastAPI's reading takes "2" for an
        # integer and "true" for a boolean, which the schema does not.
        CatalogModel.model_validate_json(await request.body(), strict=True)
    except ValidationError as exc:
        raise invalid_body(exc) from None
    if entry.name != name:
        raise ErrorKind.NAME_MISMATCH.error(body_name=entry.name, path_name=name)
    # The entry's own fields unprefixed (`adapters[0].name`), others by name.
    problems = await _stored(
        deps, apply_entries, deps.store, [entry], lambda _: "", deps.max_replicas
    )
    if problems:
        where = problems[0].split(":")[0]
        own = where.startswith(("adapters", "profile", "autoscale", "queue", "replicas"))
        raise invalid_fields(problems, where if own else "name")
    return entry


@router.delete("/models/{name}", responses=NO_MODEL)
async def admin_delete_model(name: str, deps: DepsDep) -> dict[str, Any]:
    """Remove a catalog entry (running replicas are not stopped)."""
    if not await _stored(deps, delete_entry, deps.store, name):
        raise ErrorKind.NOT_FOUND.error(what="model", name=name)
    return {"deleted": name}


class ScaleRequest(BaseModel):
    """POST /admin/models/{name}/scale: a fixed count, or bounds to follow the load within."""

    model_config = ConfigDict(extra="forbid")

    # Strict, as every integer of the admin API: a string is refused.
    replicas: int | None = Field(
        default=None, ge=0, le=INT32_MAX, strict=True, description="a fixed count (autoscale off)"
    )
    min_replicas: int | None = Field(default=None, ge=0, le=INT32_MAX, strict=True)
    max_replicas: int | None = Field(default=None, ge=1, le=INT32_MAX, strict=True)


@router.post(
    "/models/{name}/scale",
    responses=error_responses(
        {
            400: "An invalid field, or a count past LLMGW_MAX_REPLICAS_PER_MODEL"
            " (`param` names it)",
            404: "No such catalog entry (`not_found`)",
            **TEMPORAL,
        }
    ),
)
async def admin_scale_model(name: str, request: ScaleRequest, deps: DepsDep) -> DeploymentStatus:
    """Scale the model's deployment (started if it was not), as ``llmgw scale``:
    the catalog entry first, so that the control plane's reconcile agrees.
    Counts past LLMGW_MAX_REPLICAS_PER_MODEL are refused, naming it."""
    asked = request.model_dump(exclude_none=True)
    if over := [f for f, n in asked.items() if n > deps.max_replicas]:
        problems = [
            f"{f}: {asked[f]} is more than LLMGW_MAX_REPLICAS_PER_MODEL ({deps.max_replicas})"
            for f in over
        ]
        raise invalid_fields(problems, over[0])
    client = _temporal(deps)
    if await _stored(deps, get_entry, deps.store, name) is None:
        raise ErrorKind.NOT_FOUND.error(what="model", name=name)
    try:
        return await asyncio.wait_for(
            scale_model(
                client, deps.store, name,
                request.replicas, request.min_replicas, request.max_replicas, deps.max_replicas,
            ),
            35,
        )  # fmt: skip
    except ConfigError as exc:
        raise invalid_fields([str(exc)], str(exc).split(":")[0]) from exc
    except (RPCError, TimeoutError, LlmgwError) as exc:
        raise ErrorKind.TEMPORAL_UNAVAILABLE.error(exc=exc) from exc


# Replicas and nodes -----------------------------------------------------


class ReplicaView(ReplicaMemo):
    """A replica as the router sees it."""

    inflight: int = 0
    held_tokens: int = Field(
        default=0,
        description="prompt tokens this router believes the replica's prefix cache holds"
        " (its index, docs/guides/routing.md; estimated tokens, another router's differ)",
    )
    pinned_slots: int = Field(
        default=0,
        description="llama.cpp slots of the replica this router has pinned a conversation"
        " to (catalog routing.slots)",
    )


@router.get("/replicas")
async def admin_replicas(deps: DepsDep) -> list[ReplicaView]:
    """Every running replica and its state (as of the last routing refresh)."""
    inflight = {r.replica_id: r.inflight for rs in deps.table.routes.values() for r in rs}
    affinity = deps.affinity
    return [
        ReplicaView(
            **m.model_dump(),
            inflight=inflight.get(m.replica_id, 0),
            held_tokens=affinity.held_tokens(m.model, m.replica_id) if affinity else 0,
            pinned_slots=affinity.pinned_slots(m.replica_id) if affinity else 0,
        )
        for m in deps.table.replicas
    ]


def _replica(deps: Deps, replica_id: str) -> ReplicaMemo:
    for memo in deps.table.replicas:
        if memo.replica_id == replica_id:
            return memo
    raise ErrorKind.NOT_FOUND.error(what="running replica", name=replica_id)


class LogTailView(BaseModel):
    replica_id: str
    lines: list[str]


@router.get("/replicas/{replica_id}/logs", responses={**NO_REPLICA, **error_responses(TEMPORAL)})
async def admin_replica_logs(
    replica_id: str, deps: DepsDep, lines: Annotated[int, Query(ge=1, le=2000)] = 100
) -> LogTailView:
    """The last lines the replica's engine wrote, fetched from its node."""
    _replica(deps, replica_id)
    client = _temporal(deps)
    try:
        tail = await asyncio.wait_for(replicas.log_tail(client, replica_id, lines), 35)
    except (RPCError, TimeoutError, LlmgwError) as exc:
        raise ErrorKind.TEMPORAL_UNAVAILABLE.error(exc=exc) from exc
    return LogTailView(replica_id=replica_id, lines=tail)


class EngineKeyView(BaseModel):
    replica_id: str
    endpoint: str
    engine_key: str


@router.get("/replicas/{replica_id}/engine-key", responses=NO_REPLICA)
async def admin_engine_key(replica_id: str, deps: DepsDep) -> EngineKeyView:
    """The replica's engine key, to benchmark its engine directly."""
    memo = _replica(deps, replica_id)
    return EngineKeyView(
        replica_id=replica_id, endpoint=memo.endpoint, engine_key=deps.engine_key(replica_id)
    )


@router.get("/nodes", responses=error_responses(TEMPORAL))
async def admin_nodes(deps: DepsDep) -> dict[str, Any]:
    """The fleet: nodes, their liveness, allocations and cordons."""
    client = _temporal(deps)
    try:
        snap = await replicas.fleet_snapshot(client)
    except RPCError as exc:
        raise ErrorKind.TEMPORAL_UNAVAILABLE.error(exc=exc) from exc
    return snap.model_dump(mode="json")


# Errors -----------------------------------------------------------------


@router.get("/errors")
async def admin_errors(
    deps: DepsDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[Incident]:
    """The latest errors clients got as a fixed message and an error id, with
    their full reasons, newest first (this router's; its log keeps them all)."""
    return deps.admission.incidents.recent(limit)


@router.get(
    "/errors/{error_id}",
    responses=error_responses({404: "No such error id on this router (`not_found`)"}),
)
async def admin_error(error_id: str, deps: DepsDep) -> Incident:
    """Why the client given ``error_id`` (its ``x-request-id``) failed. Only the
    router that answered knows; the latest 1,000 are kept, the log has every one."""
    incident = deps.admission.incidents.get(error_id)
    if incident is None:
        raise ErrorKind.NOT_FOUND.error(what="error id on this router", name=error_id)
    return incident


# Keys and usage ---------------------------------------------------------


class NewKey(BaseModel):
    """POST /admin/keys."""

    model_config = ConfigDict(extra="forbid")

    name: KeyName
    policy: KeyPolicy = Field(default_factory=KeyPolicy)


class CreatedKey(KeyInfo):
    key: str = Field(description="the key itself: shown this once, stored hashed")


@router.get("/keys")
async def admin_list_keys(deps: DepsDep) -> list[KeyInfo]:
    """Every key (never the keys themselves)."""
    return await _stored(deps, apikeys.list_keys, deps.store)


@router.post("/keys", status_code=201)
async def admin_create_key(new: NewKey, deps: DepsDep) -> CreatedKey:
    """Create a key; the response is the only time it is shown."""
    info, key = await _stored(deps, apikeys.create_key, deps.store, new.name, new.policy)
    return CreatedKey(**info.model_dump(), key=key)


@router.get(
    "/keys/{key_id}",
    responses=error_responses({404: "No such key, or it was revoked (`not_found`)"}),
)
async def admin_get_key(key_id: KeyId, deps: DepsDep) -> KeyInfo:
    """One live key. A revoked (deleted) one is gone here (404), as after
    any DELETE; ``GET /admin/keys`` still lists it (``revoked``), for its
    usage history."""
    info = await _stored(deps, apikeys.get_key, deps.store, key_id)
    if info is None or info.revoked:
        raise ErrorKind.NOT_FOUND.error(what="key", name=str(key_id))
    return info


@router.delete("/keys/{key_id}", responses=NO_KEY)
async def admin_revoke_key(key_id: KeyId, deps: DepsDep) -> KeyInfo:
    """Revoke a key: refused here at once, by other routers within their cache TTL."""
    info = await _stored(deps, apikeys.revoke_key, deps.store, key_id)
    if info is None:
        raise ErrorKind.NOT_FOUND.error(what="key", name=str(key_id))
    deps.keys.forget(key_id)
    return info


@router.patch(
    "/keys/{key_id}",
    responses={
        **NO_KEY,
        **error_responses({409: "The key is revoked: its policy cannot change (`key_revoked`)"}),
    },
)
async def admin_update_key(key_id: KeyId, update: KeyUpdate, deps: DepsDep) -> KeyInfo:
    """Change a key's name, models, expiry or quotas (only the fields given).
    Applies here at once, on other routers within their key cache TTL; quota
    windows already counted keep their counts. A revoked key is not changed
    (409)."""
    info = await _stored(deps, apikeys.update_key, deps.store, key_id, update)
    if info is None:
        raise ErrorKind.NOT_FOUND.error(what="key", name=str(key_id))
    if info.revoked:
        raise ErrorKind.KEY_REVOKED.error(key_id=key_id)
    deps.keys.forget(key_id)
    return info


@router.get("/usage")
async def admin_usage(
    deps: DepsDep,
    key_id: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None,
    model: str | None = None,
    since: Annotated[str | None, Query(pattern=r"^\d{4}-\d{2}-\d{2}$")] = None,
    until: Annotated[str | None, Query(pattern=r"^\d{4}-\d{2}-\d{2}$")] = None,
) -> list[UsageRow]:
    """Usage per key, model and UTC day (written in batches: up to a second behind)."""
    await deps.accountant.flush()
    return await _stored(deps, usage.query, deps.store, key_id, model, since, until)
