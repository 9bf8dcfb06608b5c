"""Usage counters per key, model and UTC day (``UsageDaily``), added to in a
caller's transaction.

Shared by the router (its batched usage flush, router/billing/usage.py) and
the control worker (a batch line's usage, billed in the same transaction as
the line's result: exactly once per ``(batch, custom_id)``). Rows are added
to (``UPDATE ... SET n = n + d``), never overwritten, since every router and
worker adds to the same rows; a missing row is inserted, and when another
writer inserted it first the insert is undone (a savepoint) and the update
retried. Portable SQL: SQLite and PostgreSQL.
"""

from sqlalchemy import Table, and_, insert, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from llmgw.store.gateway_tables import UsageDaily

_T: Table = UsageDaily.__table__  # type: ignore[attr-defined]

# Insert races lost in a row: another writer keeps inserting and deleting it.
_TRIES = 3


def add_usage(
    session: Session,
    key_id: int,
    model: str,
    day: str,
    *,
    requests: int = 1,
    errors: int = 0,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
) -> None:
    """Add to the key's usage row of ``day`` (YYYY-MM-DD) within the session's
    transaction; the caller commits (or rolls back: then nothing was added)."""
    conn = session.connection()
    add = (
        update(_T)
        .where(and_(_T.c.key_id == key_id, _T.c.model == model, _T.c.day == day))
        .values(
            requests=_T.c.requests + requests,
            errors=_T.c.errors + errors,
            prompt_tokens=_T.c.prompt_tokens + prompt_tokens,
            completion_tokens=_T.c.completion_tokens + completion_tokens,
        )
    )
    for _ in range(_TRIES):
        if conn.execute(add).rowcount == 1:
            return
        try:
            with session.begin_nested():
                session.connection().execute(
                    insert(_T).values(
                        key_id=key_id,
                        model=model,
                        day=day,
                        requests=requests,
                        errors=errors,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens,
                    )
                )
            return
        except IntegrityError:
            continue  # another writer inserted it: add to theirs
    raise IntegrityError("usage_daily insert", {}, Exception("the row kept changing"))
