"""The jobs' rows (batches, background responses) as their starters mark them.

A row is marked started once its workflow's start was asked for, by the
router that inserted it (router/control_link/jobs.py) or by the control
worker's sweeper (activities/control/jobs_sweeper.py), which starts the rows
left unmarked: one function, so that both mark a row the same way.
"""

from sqlalchemy import update

from llmgw.store import Store
from llmgw.store.openai_tables import BatchRecord, ResponseRecord


def mark_started(
    store: Store, table: type[BatchRecord | ResponseRecord], row_id: str, now: int
) -> None:
    """Set the row's ``started_at`` to ``now`` unless it is set already."""
    # Both tables have started_at; a plain UPDATE keeps it one statement.
    t = table.__table__  # type: ignore[union-attr]
    with store.session() as session:
        session.connection().execute(
            update(t).where(t.c.id == row_id, t.c.started_at.is_(None)).values(started_at=now)
        )
        session.commit()
