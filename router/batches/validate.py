"""A batch's input lines checked before any of them runs, and copied into
``BatchLine`` rows.

Each line must be a JSON object with a unique non-empty ``custom_id``,
``method`` POST, ``url`` equal to the batch's endpoint and a ``body`` that
the endpoint would take, naming a model the key may use and the router
knows. The endpoint's own check of a body is injected (``BodyCheck``: the
router's request schemas live above this package). Problems are reported
as OpenAI's batch errors, ``{code, line, message, param}`` (line 1-based),
the first one of each line.

Lines are written ``WRITE_CHUNK`` per transaction, after deleting the
batch's earlier ones: validating twice (a retried activity) leaves the same
rows. A file with any bad line leaves no rows at all (no line of it runs).
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import delete, update
from sqlmodel import col

from llmgw.errors import LlmgwError
from llmgw.store import Store
from llmgw.store.openai_tables import BatchLine, BatchRecord

# OpenAI's bound on the requests of one batch.
MAX_LINES = 50_000
# The most errors listed (every bad line is still found; the rest are counted).
MAX_ERRORS = 1000
# BatchLine rows written per transaction.
WRITE_CHUNK = 1000


class BodyRefused(LlmgwError):
    """The endpoint would refuse this body: why, and the field at fault."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# The endpoint's check of one line's body: the model it names, or BodyRefused.
BodyCheck = Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class LineError:
    """One problem found, as OpenAI's ``BatchError``."""

    code: str
    line: int | None
    message: str
    param: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


@dataclass(frozen=True)
class Rules:
    """What a batch's lines must satisfy: its endpoint, the endpoint's body
    check, and the models the key may use and the router knows."""

    endpoint: str
    check_body: BodyCheck
    allows: Callable[[str], bool]
    knows: Callable[[str], bool]


@dataclass
class Validation:
    """The outcome: how many requests the file holds, and its errors (at
    most ``MAX_ERRORS``; ``error_count`` counts them all)."""

    total: int = 0
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0

    def add(self, error: LineError) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)


class LineChecker:
    """Checks lines one after another (it remembers the custom_ids seen)."""

    def __init__(self, rules: Rules) -> None:
        self._rules = rules
        self._seen: dict[str, int] = {}

    def check(self, line: int, raw: bytes) -> BatchLine | LineError:
        """The line as a row to store, or its first problem."""

        def error(code: str, message: str, param: str | None = None) -> LineError:
            return LineError(code, line, message, param)

        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return error("invalid_json_line", "This line is not valid JSON.")
        if not isinstance(data, dict):
            return error("invalid_json_line", "This line is not a JSON object.")
        custom_id = data.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return error(
                "missing_custom_id", "This line has no custom_id (a non-empty string).", "custom_id"
            )
        if custom_id in self._seen:
            first = self._seen[custom_id]
            return error(
                "duplicate_custom_id",
                f"The custom_id '{custom_id[:100]}' is used on line {first} already.",
                "custom_id",
            )
        self._seen[custom_id] = line
        method = data.get("method")
        if method != "POST":
            return error("invalid_method", f"The method must be POST, not {method!r}.", "method")
        url, endpoint = data.get("url"), self._rules.endpoint
        if url != endpoint:
            return error(
                "mismatched_url",
                f"The url {url!r} differs from the batch's endpoint '{endpoint}'.",
                "url",
            )
        body = data.get("body")
        if not isinstance(body, dict):
            return error("invalid_request_body", "The body must be a JSON object.", "body")
        try:
            model = self._rules.check_body(body)
        except BodyRefused as exc:
            return error("invalid_request_body", exc.message, exc.param)
        if not self._rules.allows(model):
            return error(
                "model_not_allowed", f"This API key may not use the model `{model}`.", "body.model"
            )
        if not self._rules.knows(model):
            return error("model_not_found", f"The model `{model}` does not exist.", "body.model")
        return BatchLine(batch_id="", line=line, custom_id=custom_id, body=body)


def validate_batch(
    store: Store, batch_id: str, lines: Iterable[tuple[int, bytes]], rules: Rules
) -> Validation:
    """Check every line of a batch's input file, store its lines (none when
    any is bad) and its ``total``; blank lines are skipped."""
    _delete_lines(store, batch_id)
    checker, outcome = LineChecker(rules), Validation()
    pending: list[BatchLine] = []
    for number, raw in lines:
        if not raw.strip():
            continue
        outcome.total += 1
        if outcome.total > MAX_LINES:
            outcome.add(
                LineError(
                    "too_many_lines",
                    number,
                    f"A batch holds at most {MAX_LINES} requests; this file has more.",
                    None,
                )
            )
            break
        checked = checker.check(number, raw)
        if isinstance(checked, LineError):
            outcome.add(checked)
            pending = []
            continue
        if outcome.error_count:
            continue  # nothing of a bad file is stored; keep finding its errors
        checked.batch_id = batch_id
        pending.append(checked)
        if len(pending) >= WRITE_CHUNK:
            _write(store, pending)
            pending = []
    if outcome.total == 0:
        outcome.add(LineError("empty_file", None, "The input file holds no requests.", None))
    if outcome.error_count:
        _delete_lines(store, batch_id)
    else:
        _write(store, pending)
    with store.session() as session:
        session.execute(
            update(BatchRecord)
            .where(col(BatchRecord.id) == batch_id)
            .values(total=min(outcome.total, MAX_LINES))
        )
        session.commit()
    return outcome


def _delete_lines(store: Store, batch_id: str) -> None:
    with store.session() as session:
        session.execute(delete(BatchLine).where(col(BatchLine.batch_id) == batch_id))
        session.commit()


def _write(store: Store, rows: list[BatchLine]) -> None:
    if not rows:
        return
    with store.session() as session:
        session.add_all(rows)
        session.commit()
