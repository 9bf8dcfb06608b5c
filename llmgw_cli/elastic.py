"""``llmgw scale``, and the deployments' side of ``status`` and ``explain``:
desired and ready replicas, waiting requests, the autoscaler's decisions."""

from typing import Annotated

import typer
from rich.table import Table
from temporalio.client import Client
from temporalio.service import RPCError

from llmgw import replicas
from llmgw.errors import LlmgwError, TemporalConnectError
from llmgw.store import Store
from llmgw.store.catalog_store import scale_model
from llmgw.types import DeploymentStatus
from llmgw_cli.common import CliSettings, connect, console, fail, out, run
from llmgw_cli.output import DeploymentRow, print_json


def scale(
    model: str,
    count: Annotated[
        int | None, typer.Argument(min=0, help="desired replicas (a fixed count)")
    ] = None,
    replicas_: Annotated[
        int | None,
        typer.Option("--replicas", "-n", min=0, help="a fixed count (autoscaling off)"),
    ] = None,
    min_: Annotated[
        int | None, typer.Option("--min", min=0, help="autoscale: at least (0: scale to zero)")
    ] = None,
    max_: Annotated[int | None, typer.Option("--max", min=1, help="autoscale: at most")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the deployment as JSON (docs: CLI JSON output)")
    ] = False,
) -> None:
    """Start or scale the model's deployment: a fixed count, or --min/--max to
    follow the load within (written to the catalog entry too)."""
    settings = CliSettings()
    fixed = replicas_ if replicas_ is not None else count
    if fixed is None and min_ is None and max_ is None:
        fail("give a count (--replicas N) or bounds (--min N --max M)")
    store = Store(settings.resolved_store_url())
    store.migrate()

    async def go() -> DeploymentStatus:
        try:
            client = await connect(settings)
        except TemporalConnectError as exc:
            # Connected first, so that giving up leaves the catalog as it was.
            raise TemporalConnectError(
                f"{exc}\nnothing changed (catalog nor deployment): run the command again"
                " once Temporal answers"
            ) from exc
        return await scale_model(
            client, store, model, fixed, min_, max_, settings.max_replicas_per_model
        )

    try:
        status = run(go())
    except LlmgwError as exc:
        fail(str(exc))
    policy = status.autoscale
    bounds = f" (autoscale {policy.min_replicas}..{policy.max_replicas})" if policy else ""
    console.print(f"deployment/{model}: {status.desired} replicas desired{bounds}")
    if as_json:
        print_json(DeploymentRow.of(status))
        return
    table = Table("slot", "replica", "starts", "failures", "reaped", "last reason")
    for s in status.slots:
        table.add_row(
            str(s.slot), s.replica_id, str(s.starts), str(s.consecutive_failures),
            "yes" if s.reaped else "", s.last_reason,
        )  # fmt: skip
    out.print(table)


async def deployments(client: Client) -> list[DeploymentStatus]:
    """Every running deployment's state (a query each: needs a control worker)."""
    return await replicas.list_deployments(client)


def deployments_table(found: list[DeploymentStatus]) -> Table:
    """Per model: desired and ready replicas, requests in flight and waiting."""
    table = Table("model", "desired", "ready", "inflight", "waiting", "autoscale")
    for d in sorted(found, key=lambda d: d.model):
        policy = d.autoscale
        table.add_row(
            d.model, str(d.desired), str(sum(s.ready for s in d.slots)),
            str(d.load.inflight), str(d.load.waiting),
            f"{policy.min_replicas}..{policy.max_replicas}" if policy else "fixed",
        )  # fmt: skip
    return table


async def deployment_or_none(client: Client, model: str) -> DeploymentStatus | None:
    """The model's deployment; None when none runs."""
    try:
        return await replicas.deployment_status(client, model)
    except RPCError:
        return None


def autoscale_lines(model: str, status: DeploymentStatus | None) -> list[str]:
    """``llmgw explain``'s autoscale section: bounds, load, the last decisions."""
    if status is None:
        return [f"{model}: no deployment running"]
    policy = status.autoscale
    if policy is None:
        return [f"{model}: a fixed count of {status.desired} (no autoscale)"]
    lines = [
        f"{model}: autoscale {policy.min_replicas}..{policy.max_replicas}, "
        f"target {policy.target_inflight:g} in flight per replica; desired {status.desired}; "
        f"now {status.load.inflight} in flight, {status.load.waiting} waiting "
        f"({status.load.routers} routers reporting)"
    ]
    if not status.decisions:
        lines.append("  no scaling decision yet")
    lines += [f"  {d.at} {d.reason}" for d in status.decisions]
    return lines
