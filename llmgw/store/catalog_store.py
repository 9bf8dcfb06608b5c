"""The catalog in the store, as the admin API and the router read it."""

import asyncio
from collections.abc import Callable

from pydantic import ValidationError
from sqlmodel import select
from temporalio.client import Client

from llmgw import replicas as deployments
from llmgw.catalog import DEFAULT_MAX_REPLICAS, CatalogModel, problems_with, replica_problems
from llmgw.errors import ConfigError
from llmgw.store import ModelRecord, Store
from llmgw.types import AutoscalePolicy, DeploymentStatus, ModelSpec


def all_specs(store: Store) -> dict[str, ModelSpec]:
    """Every catalog model's spec by name."""
    with store.session() as session:
        return {r.name: r.spec() for r in session.exec(select(ModelRecord)).all()}


def list_entries(store: Store) -> list[CatalogModel]:
    """Every catalog entry with its desired replicas, by name."""
    with store.session() as session:
        rows = session.exec(select(ModelRecord).order_by(ModelRecord.name)).all()
        return [CatalogModel(**r.spec().model_dump(), replicas=r.replicas) for r in rows]


def get_entry(store: Store, name: str) -> CatalogModel | None:
    """One catalog entry."""
    with store.session() as session:
        row = session.get(ModelRecord, name)
        return CatalogModel(**row.spec().model_dump(), replicas=row.replicas) if row else None


def delete_entry(store: Store, name: str) -> bool:
    """Remove a model from the catalog; the control plane's reconcile pass then
    scales its deployment away and stops its replicas (workflows/reconcile.py)."""
    return store.delete_model(name)


def apply_entries(
    store: Store,
    entries: list[CatalogModel],
    label: Callable[[int], str] = lambda i: f"models[{i}].",
    max_replicas: int = DEFAULT_MAX_REPLICAS,
) -> list[str]:
    """Add or replace ``entries`` unless they break the catalog; the problems
    (none: written). Checked and written under the catalog lock, so writers
    in other processes cannot slip a clashing entry in between."""
    with store.catalog_lock():
        problems = problems_with(entries, list_entries(store), label, max_replicas)
        if problems:
            return problems
        for entry in entries:
            store.put_model(entry.spec(), entry.replicas)
    return []


def scaled_entry(
    entry: CatalogModel,
    replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
) -> CatalogModel:
    """``entry`` scaled: bounds given follow the load within them (the other
    bound and the rest of the policy as the entry had them); a count alone
    is a fixed count (autoscaling off). A ConfigError names a bad field."""
    if min_replicas is None and max_replicas is None:
        if replicas is None:
            raise ConfigError("replicas: give a count, or min_replicas/max_replicas")
        return entry.model_copy(update={"autoscale": None, "replicas": replicas})
    bounds = {
        k: v
        for k, v in (("min_replicas", min_replicas), ("max_replicas", max_replicas))
        if v is not None
    }
    try:
        policy = AutoscalePolicy.model_validate(
            {**(entry.autoscale or AutoscalePolicy()).model_dump(), **bounds}
        )
    except ValidationError as exc:
        problems = [
            f"autoscale{''.join('.' + str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        ]
        raise ConfigError("; ".join(problems)) from exc
    count = entry.replicas if replicas is None else replicas
    return entry.model_copy(update={"autoscale": policy, "replicas": count})


async def scale_model(
    client: Client,
    store: Store,
    name: str,
    replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    limit: int = DEFAULT_MAX_REPLICAS,
) -> DeploymentStatus:
    """``llmgw scale`` and the admin API: the catalog entry first (so that
    the reconcile pass agrees and the routers see the bounds), then the
    deployment (started if it was not). Counts past ``limit``
    (LLMGW_MAX_REPLICAS_PER_MODEL) are a ConfigError naming it."""

    def write() -> CatalogModel:
        with store.catalog_lock():
            entry = get_entry(store, name)
            if entry is None:
                raise ConfigError(f"model {name!r} is not in the catalog")
            scaled = scaled_entry(entry, replicas, min_replicas, max_replicas)
            if problems := replica_problems(scaled, limit):
                raise ConfigError("; ".join(problems))
            store.put_model(scaled.spec(), scaled.replicas)
            return scaled

    scaled = await asyncio.to_thread(write)
    return await deployments.apply_deployment(client, scaled.spec(), scaled.replicas)
