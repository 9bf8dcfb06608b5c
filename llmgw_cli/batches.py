"""``llmgw batches``: every key's batches (``/v1/batches``), straight from the
store, for operators: what runs, for whom, how far along. Clients see only
their own key's through the API; the Temporal UI shows the same progress on
each ``batch/<id>`` workflow."""

from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table

from llmgw_cli.common import CliSettings, open_store, out
from llmgw_cli.common import fail as _fail
from llmgw_cli.output import BatchDetail, BatchesOutput, BatchRow, BatchShowOutput, print_json

batches_app = typer.Typer(help="Batches (/v1/batches) of every key", no_args_is_help=True)

_JSON_HELP = "print JSON (docs: CLI JSON output)"


def _time(when: datetime | None) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if when else "-"


@batches_app.command("list")
def batches_list(
    key: Annotated[int | None, typer.Option(help="only this key's batches (its id)")] = None,
    limit: Annotated[int, typer.Option(min=1, help="the newest this many")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False,
) -> None:
    """Batches, newest first: id, key, endpoint, status, counts, created."""
    from router.batches.records import list_batches  # noqa: PLC0415

    rows, more = list_batches(open_store(CliSettings()), key, limit=limit)
    listed = BatchesOutput(batches=[BatchRow.of(r) for r in rows], has_more=more)
    if as_json:
        print_json(listed)
        return
    table = Table("id", "key", "endpoint", "status", "done/failed/total", "created")
    for row in listed.batches:
        table.add_row(
            row.id, str(row.key_id), row.endpoint, row.status,
            f"{row.completed}/{row.failed}/{row.total}", _time(row.created_at),
        )  # fmt: skip
    out.print(table)
    if more:
        out.print(f"(the newest {limit}; --limit shows more)")


@batches_app.command("show")
def batches_show(
    batch_id: str, as_json: Annotated[bool, typer.Option("--json", help=_JSON_HELP)] = False
) -> None:
    """One batch: status, every timestamp, counts, tokens, files and errors."""
    from router.batches.records import get_batch  # noqa: PLC0415

    record = get_batch(open_store(CliSettings()), None, batch_id)
    if record is None:
        _fail(f"no batch {batch_id!r}")
    detail = BatchDetail.of(record)
    if as_json:
        print_json(BatchShowOutput(batch=detail))
        return
    lines = [
        f"batch {detail.id}: {detail.status}",
        f"  key {detail.key_id}, {detail.endpoint}, input file {detail.input_file_id}",
        f"  requests: {detail.total} total, {detail.completed} completed, {detail.failed} failed",
        f"  tokens: {detail.input_tokens} in, {detail.output_tokens} out",
        f"  output file: {detail.output_file_id or '-'}, error file: {detail.error_file_id or '-'}",
    ]
    for name in (
        "created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
        "expired_at", "cancelling_at", "cancelled_at", "expires_at",
    ):  # fmt: skip
        when = getattr(detail, name)
        if when is not None:
            lines.append(f"  {name}: {_time(when)}")
    for error in detail.errors:
        lines.append(f"  error line {error.line}: {error.code} ({error.param}): {error.message}")
    if detail.metadata:
        lines.append(f"  metadata: {detail.metadata}")
    out.print("\n".join(lines), markup=False, highlight=False)
