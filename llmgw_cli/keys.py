"""``llmgw keys``: client API keys, straight in the store."""

from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.table import Table

from llmgw.store import Store
from llmgw_cli.common import CliSettings, console, out
from llmgw_cli.common import fail as _fail
from llmgw_cli.output import KeyRow, KeysOutput, print_json

keys_app = typer.Typer(help="Client API keys", no_args_is_help=True)


def _store() -> Store:
    store = Store(CliSettings().resolved_store_url())
    store.migrate()
    return store


def _expiry(text: str) -> datetime:
    """``30d``, ``12h``, ``15m`` from now, or an ISO date/time (UTC when no zone)."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text[:-1].isdigit() and text[-1:] in units:
        return datetime.now(UTC) + timedelta(seconds=int(text[:-1]) * units[text[-1]])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        _fail(f"--expires: {text!r} is neither a duration (30d, 12h, 15m) nor an ISO date")
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@keys_app.command("create")
def keys_create(
    name: str,
    models: Annotated[
        str, typer.Option(help="comma-separated models the key may use (default: all)")
    ] = "",
    expires: Annotated[str, typer.Option(help="expiry: a duration (30d, 12h) or an ISO date")] = "",
    admin: Annotated[bool, typer.Option("--admin", help="an admin API key")] = False,
    rpm: Annotated[int, typer.Option(min=0, help="requests per minute (0 = no limit)")] = 0,
    tpm: Annotated[int, typer.Option(min=0, help="tokens per minute (0 = no limit)")] = 0,
    budget: Annotated[int, typer.Option(min=0, help="tokens per budget period")] = 0,
    budget_period: Annotated[str, typer.Option(help="day or month")] = "day",
    weight: Annotated[
        float, typer.Option(help="share of a busy model's tokens relative to other keys")
    ] = 1.0,
    priority: Annotated[str, typer.Option(help="queue class: high, normal or batch")] = "normal",
) -> None:
    """Create a client API key; it is printed once and stored hashed."""
    from pydantic import ValidationError  # noqa: PLC0415

    from router.api.apikeys import create_key  # noqa: PLC0415
    from router.billing.key_policy import KeyPolicy  # noqa: PLC0415

    try:
        policy = KeyPolicy(
            models=[m.strip() for m in models.split(",") if m.strip()],
            expires_at=_expiry(expires) if expires else None,
            admin=admin,
            rpm=rpm,
            tpm=tpm,
            token_budget=budget,
            budget_period=budget_period,  # validated by KeyPolicy
            weight=weight,
            priority=priority,  # validated by KeyPolicy
        )
    except ValidationError as exc:
        _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    store = _store()
    info, key = create_key(store, name, policy)
    console.print(f"key {info.id} ({name}) created; it is shown once:")
    out.print(key)


@keys_app.command("list")
def keys_list(
    as_json: Annotated[
        bool, typer.Option("--json", help="print JSON (docs: CLI JSON output)")
    ] = False,
) -> None:
    """Every key: id, name, prefix, policy (never the key itself)."""
    from router.api.apikeys import list_keys  # noqa: PLC0415

    store = _store()
    if as_json:
        print_json(KeysOutput(keys=[KeyRow.of(k) for k in list_keys(store)]))
        return
    table = Table("id", "name", "prefix", "created", "state", "models", "expires", "limits")
    for k in list_keys(store):
        p = k.policy
        limits = ", ".join(
            f"{label} {value}"
            for label, value in (
                ("rpm", p.rpm), ("tpm", p.tpm), (f"tokens/{p.budget_period}", p.token_budget)
            )
            if value
        )  # fmt: skip
        if p.weight != 1.0 or p.priority.value != "normal":
            queue = f"weight {p.weight:g}, {p.priority.value}"
            limits = f"{limits}, {queue}" if limits else queue
        table.add_row(
            str(k.id), k.name, k.prefix + "…", k.created_at.strftime("%Y-%m-%d %H:%M"),
            KeyRow.of(k).state,
            ",".join(p.models) or "all",
            p.expires_at.strftime("%Y-%m-%d %H:%M") if p.expires_at else "never",
            limits or "none",
        )  # fmt: skip
    out.print(table)


@keys_app.command("update")
def keys_update(
    key_id: int,
    name: Annotated[str | None, typer.Option(help="a new name")] = None,
    models: Annotated[
        str | None, typer.Option(help="comma-separated models the key may use ('' = all)")
    ] = None,
    expires: Annotated[
        str | None, typer.Option(help="expiry: a duration (30d, 12h), an ISO date, or 'never'")
    ] = None,
    rpm: Annotated[int | None, typer.Option(min=0, help="requests per minute (0: none)")] = None,
    tpm: Annotated[int | None, typer.Option(min=0, help="tokens per minute (0: none)")] = None,
    budget: Annotated[int | None, typer.Option(min=0, help="tokens per budget period")] = None,
    budget_period: Annotated[str | None, typer.Option(help="day or month")] = None,
    weight: Annotated[
        float | None, typer.Option(help="share of a busy model's tokens relative to other keys")
    ] = None,
    priority: Annotated[str | None, typer.Option(help="queue class: high, normal or batch")] = None,
) -> None:
    """Change a key's name, models, expiry, quotas or queue weight and priority;
    what is not given stays.
    Routers apply it within their key cache TTL (5 s by default)."""
    from pydantic import ValidationError  # noqa: PLC0415

    from router.api.apikeys import KeyUpdate, update_key  # noqa: PLC0415

    changes: dict[str, object] = {
        "name": name, "rpm": rpm, "tpm": tpm, "token_budget": budget,
        "budget_period": budget_period, "weight": weight, "priority": priority,
    }  # fmt: skip
    if models is not None:
        changes["models"] = [m.strip() for m in models.split(",") if m.strip()]
    if expires is not None:
        changes["expires_at"] = None if expires == "never" else _expiry(expires)
    try:
        update = KeyUpdate.model_validate(
            {k: v for k, v in changes.items() if v is not None or k == "expires_at"}
        )
    except ValidationError as exc:
        _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    if not update.model_fields_set:
        _fail("nothing to change: give at least one option")
    store = _store()
    info = update_key(store, key_id, update)
    if info is None:
        _fail(f"no key {key_id}")
    if info.revoked:
        _fail(f"key {key_id} is revoked: its policy cannot change")
    p = info.policy
    console.print(
        f"key {key_id} ({info.name}) updated: models {','.join(p.models) or 'all'}, "
        f"expires {p.expires_at.isoformat() if p.expires_at else 'never'}, "
        f"rpm {p.rpm}, tpm {p.tpm}, tokens/{p.budget_period} {p.token_budget}, "
        f"weight {p.weight:g}, priority {p.priority.value}"
    )


@keys_app.command("revoke")
def keys_revoke(key_id: int) -> None:
    """Revoke a key (routers refuse it within their key cache TTL, 5 s by default)."""
    from router.api.apikeys import revoke_key  # noqa: PLC0415

    store = _store()
    if revoke_key(store, key_id) is None:
        _fail(f"no key {key_id}")
    console.print(f"key {key_id} revoked")
