"""The catalog in the store, as the admin API and the router read it."""

from collections.abc import Callable

from sqlmodel import select

from llmgw.catalog import CatalogModel, problems_with
from llmgw.store import ModelRecord, Store
from llmgw.types import ModelSpec


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
) -> list[str]:
    """Add or replace ``entries`` unless they break the catalog; the problems
    (none: written). Checked and written under the catalog lock, so writers
    in other processes cannot slip a clashing entry in between."""
    with store.catalog_lock():
        problems = problems_with(entries, list_entries(store), label)
        if problems:
            return problems
        for entry in entries:
            store.put_model(entry.spec(), entry.replicas)
    return []
