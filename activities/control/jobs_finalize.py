"""A batch's end: its output and error files, written from the store (the
``finalize_batch`` activity).

Split from activities/control/jobs.py, whose activity delegates here. The
files' ids are deterministic (a retried finalize replaces them), their lines
in input order, read a page of rows at a time; lines that never ran are in
the error file with the workflow's ``never_ran_code``.
"""

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import and_, func
from sqlmodel import col, select
from temporalio.exceptions import ApplicationError

from activities.control import jobs_lines as rules
from llmgw.store import Store
from llmgw.store.files import write_file
from llmgw.store.openai_tables import BatchLine, BatchRecord, BatchResult
from llmgw.types import FinalizeBatch, Finalized

# Results files are written from the store: no bound but the store's.
RESULT_FILE_MAX_BYTES = 1 << 40
# Rows read per page by finalize.
PAGE = 500


class Finalizer:
    """Writes a batch's result files (JobActivities.finalize_batch)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def finalize(self, arg: FinalizeBatch) -> Finalized:
        """Write the batch's files and set them on it (blocking: run in a thread)."""
        with self._store.session() as session:
            batch = session.get(BatchRecord, arg.batch_id)
            if batch is None:
                raise ApplicationError(f"no batch {arg.batch_id}", non_retryable=True)
            key_id = batch.key_id
        oks, errors, never = self._counts(arg.batch_id)
        if not arg.never_ran_code:
            never = 0  # a completed batch ran every line
        out_id = err_id = None
        if oks:
            out_id = rules.result_file_id(arg.batch_id, "out")
            write_file(
                self._store, key_id, f"{arg.batch_id}_output.jsonl", "batch_output",
                self._jsonl(arg.batch_id, want_ok=True, never_ran_code=""),
                max_bytes=RESULT_FILE_MAX_BYTES, file_id=out_id,
            )  # fmt: skip
        if errors or never:
            err_id = rules.result_file_id(arg.batch_id, "err")
            write_file(
                self._store, key_id, f"{arg.batch_id}_error.jsonl", "batch_output",
                self._jsonl(arg.batch_id, want_ok=False, never_ran_code=arg.never_ran_code),
                max_bytes=RESULT_FILE_MAX_BYTES, file_id=err_id,
            )  # fmt: skip
        with self._store.session() as session:
            batch = session.get(BatchRecord, arg.batch_id)
            assert batch is not None
            batch.output_file_id = out_id
            batch.error_file_id = err_id
            if never:
                # Lines that never ran are in the error file: counted as failed
                # (assigned, not added: finalize may run twice).
                batch.failed = batch.total - batch.completed
            session.add(batch)
            session.commit()
        return Finalized(output_file_id=out_id, error_file_id=err_id)

    def _counts(self, batch_id: str) -> tuple[int, int, int]:
        """(ok results, failed results, lines without a result)."""
        with self._store.session() as session:
            oks = session.exec(
                select(func.count())
                .select_from(BatchResult)
                .where(BatchResult.batch_id == batch_id, col(BatchResult.ok).is_(True))
            ).one()
            results = session.exec(
                select(func.count())
                .select_from(BatchResult)
                .where(BatchResult.batch_id == batch_id)
            ).one()
            lines = session.exec(
                select(func.count()).select_from(BatchLine).where(BatchLine.batch_id == batch_id)
            ).one()
        return int(oks), int(results) - int(oks), max(0, int(lines) - int(results))

    def _jsonl(self, batch_id: str, *, want_ok: bool, never_ran_code: str) -> Iterator[bytes]:
        """The file's lines in input order, a page of rows at a time."""
        after = 0
        while True:
            with self._store.session() as session:
                rows = session.exec(
                    select(BatchLine.line, BatchLine.custom_id, BatchResult)
                    .join(
                        BatchResult,
                        and_(
                            col(BatchResult.batch_id) == col(BatchLine.batch_id),
                            col(BatchResult.custom_id) == col(BatchLine.custom_id),
                        ),
                        isouter=True,
                    )
                    .where(BatchLine.batch_id == batch_id, col(BatchLine.line) > after)
                    .order_by(col(BatchLine.line))
                    .limit(PAGE)
                ).all()
                page: list[bytes] = []
                for number, custom_id, result in rows:
                    after = number
                    if result is None:
                        if not want_ok and never_ran_code:
                            page.append(
                                _dump(rules.never_ran_line(batch_id, custom_id, never_ran_code))
                            )
                        continue
                    if result.ok is want_ok:
                        page.append(
                            _dump(
                                rules.output_line(
                                    batch_id, custom_id, result.status_code, result.request_id,
                                    result.body,
                                )
                            )
                        )  # fmt: skip
            if not rows:
                return
            if page:
                yield b"".join(page)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
