"""``llmgw model``: the catalog: apply a file, list it, show one entry."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.table import Table

from llmgw import replicas
from llmgw.errors import LlmgwError
from llmgw.store.catalog_store import apply_entries, get_entry, list_entries
from llmgw.types import EngineKind
from llmgw_cli.common import CliSettings, connect, console, fail, open_store, out, run
from llmgw_cli.node_checks import node_checks
from llmgw_cli.output import ModelsOutput, print_json

if TYPE_CHECKING:
    from llmgw.catalog import CatalogModel
    from llmgw.store import Store

model_app = typer.Typer(help="The model catalog", no_args_is_help=True)

_JSON_HELP = "print JSON (docs: CLI JSON output)"


@model_app.command("apply")
def model_apply(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    deploy_: Annotated[
        bool, typer.Option("--deploy", help="also scale each model's deployment")
    ] = False,
    refresh: Annotated[
        bool,
        typer.Option(
            "--refresh",
            help="re-resolve hf:// and s3:// sources pinned before (a commit, objects' ETags)",
        ),
    ] = False,
) -> None:
    """Add or update catalog models from a YAML file; hf:// sources are pinned
    to the commit their revision names now (kept on re-apply until --refresh)."""
    from llmgw.catalog import parse_catalog  # noqa: PLC0415
    from llmgw.catalog_sources import check_sources, needs_nodes  # noqa: PLC0415

    settings = CliSettings()
    try:
        entries = parse_catalog(file.read_text(), settings.max_replicas_per_model)
    except LlmgwError as exc:
        fail(f"{file}: {exc}")
    # What the agents would refuse, refused now rather than at a replica's start.
    # (Remote sources only: no node to ask, and no wait on an absent fleet.)
    if any(needs_nodes(e) for e in entries):
        check = run(node_checks(settings, entries))
    else:
        check = check_sources(entries, {})
    for note in check.notes:
        console.print(f"[yellow]note:[/yellow] {note}", markup=True, highlight=False)
    if check.problems:
        fail(f"{file}: " + "; ".join(check.problems))
    store = open_store(settings)
    entries = _pinned(settings, store, entries, refresh, file)
    # Checked against the rest of the catalog and written in one go, or not at all.
    problems = apply_entries(store, entries, max_replicas=settings.max_replicas_per_model)
    if problems:
        fail(f"{file}: " + "; ".join(problems))
    for entry in entries:
        console.print(
            f"model {entry.name}: {entry.engine.value}, {_replicas_line(entry)}{_pin_line(entry)}"
        )
    if not deploy_:
        return

    async def go() -> None:
        client = await connect(settings)
        for entry in entries:
            status = await replicas.apply_deployment(client, entry.spec(), entry.replicas)
            policy = status.autoscale
            bounds = f" (autoscale {policy.min_replicas}..{policy.max_replicas})" if policy else ""
            console.print(f"deployment/{entry.name}: {status.desired} replicas desired{bounds}")

    run(go())


def _pinned(
    settings: CliSettings,
    store: "Store",
    entries: "list[CatalogModel]",
    refresh: bool,
    file: Path,
) -> "list[CatalogModel]":
    """``entries`` with their remote sources pinned, every one checked before any
    is written; or exit naming each bad field."""
    from llmgw.catalog_sources import pin_sources  # noqa: PLC0415
    from llmgw.hub_pin import Hub  # noqa: PLC0415
    from llmgw.modelscope_pin import ModelScope  # noqa: PLC0415

    try:
        hub = Hub(settings.hf_endpoint.rstrip("/"), settings.resolved_hf_token())
    except OSError as exc:
        fail(f"LLMGW_HF_TOKEN_FILE: cannot be read ({exc.strerror})")
    try:
        modelscope = ModelScope(
            settings.modelscope_endpoint.rstrip("/"), settings.resolved_modelscope_token()
        )
    except OSError as exc:
        fail(f"LLMGW_MODELSCOPE_TOKEN_FILE: cannot be read ({exc.strerror})")
    try:
        profiles = settings.resolved_storage_profiles()
    except LlmgwError as exc:
        fail(str(exc))
    stored = {e.name: e for e in list_entries(store)}
    pinned, problems = pin_sources(
        entries, stored, hub, refresh=refresh, profiles=profiles, modelscope=modelscope
    )
    if problems:
        fail(f"{file}: " + "; ".join(problems))
    return pinned


def _pin_line(entry: "CatalogModel") -> str:
    pin = entry.pin
    if pin is None:
        return ""
    return (
        f", pinned {pin.repo}@{pin.revision[:12]} ({pin.requested}:"
        f" {len(pin.manifest.files)} files, {pin.total_bytes()} bytes)"
    )


def _replicas_line(entry: "CatalogModel") -> str:
    """How many replicas the entry asks for: its autoscale bounds when it has them."""
    policy = entry.autoscale
    if policy is None:
        return f"{entry.replicas} replica{'' if entry.replicas == 1 else 's'}"
    return f"autoscale {policy.min_replicas}..{policy.max_replicas} replicas"


@model_app.command("list")
def model_list(
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """The catalog: every model with its engine, source, GPUs and replicas."""
    entries = list_entries(open_store(CliSettings()))
    if as_json:
        print_json(ModelsOutput(models=entries))
        return
    table = Table("model", "engine", "source", "gpus", "replicas", "priority")
    for e in entries:
        table.add_row(
            e.name, e.engine.value, e.source, str(e.gpus), _replicas_line(e), str(e.priority)
        )
    out.print(table)


@model_app.command("show")
def model_show(
    name: str,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """One catalog entry: as YAML that ``llmgw model apply`` reads (fields at
    their defaults left out), or every field as JSON."""
    store = open_store(CliSettings())
    entry = get_entry(store, name)
    if entry is None:
        have = ", ".join(store.model_names()) or "none"
        fail(f"model {name!r} is not in the catalog (have: {have})")
    if as_json:
        print_json(entry)
        return
    data = entry.model_dump(mode="json", exclude_defaults=True)
    data = {"name": entry.name, **data}  # always first, even were it a default
    if entry.engine is EngineKind.LLAMA_CPP:
        # Left out, slots is filled in on apply (llmgw/types/model.py
        # with_default_slots): an entry's 0 must read back as 0.
        data["routing"] = {**data.get("routing", {}), "slots": entry.routing.slots}
    out.print(
        yaml.safe_dump({"models": [data]}, sort_keys=False), end="", markup=False, highlight=False
    )
