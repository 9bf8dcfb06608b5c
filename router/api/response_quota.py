"""A background response's quota: reserved when it is created, as a chat
request's is when it arrives, so a key limited to N requests a minute
creates at most N a minute (and their tokens count from then on).

The reservation (the key's request and every token the run may take:
``router.api.reservation.reserved_tokens`` of its chat body) is kept in the
response's row (``request["reservation"]``). The run's first attempt, on
whichever router runs it, makes its in-process chat request with it
(router.billing.accounting.HELD_RESERVATION): that request reserves
nothing more and settles this reservation with its real usage. A later
attempt (the first one's request was settled) reserves as any request does.
"""

from typing import Any

from router.api.auth import Caller
from router.api.deps import Deps
from router.api.reservation import DEFAULT_COMPLETION_RESERVE, reserved_tokens
from router.api.schemas import ChatCompletionRequest
from router.billing.accounting import RequestOutcome
from router.billing.quotas import QuotaRejection, QuotaReservation
from router.common.errors import QUOTA_EXCEEDED, ErrorKind


async def reserve_at_creation(
    deps: Deps, caller: Caller, chat: dict[str, Any]
) -> QuotaReservation | None:
    """Take the response's quota (None: its key has none), or raise the 429
    (or 400, for a request no window can admit) a chat request would get."""
    if not caller.policy.has_quota():
        return None
    body = ChatCompletionRequest.model_validate(chat)
    if body.unbounded() and (caller.policy.tpm or caller.policy.token_budget):
        raise ErrorKind.UNBOUNDED_GENERATION.error()
    target = deps.adapters.base_of(body.model)
    spec = target[0] if target else deps.table.specs.get(body.model)
    tokens = reserved_tokens(body, spec.context_length if spec else DEFAULT_COMPLETION_RESERVE)
    reservation = await deps.accountant.reserve(caller.key_id, caller.policy, tokens)
    if isinstance(reservation, QuotaRejection):
        deps.metrics.quota_rejections.labels(reservation.limit).inc()
        if reservation.never:
            raise ErrorKind.REQUEST_EXCEEDS_QUOTA.error(message=reservation.message)
        raise QUOTA_EXCEEDED[reservation.limit].error(
            message=reservation.message, retry_after_s=reservation.retry_after_s
        )
    return reservation


def stored_reservation(reservation: QuotaReservation) -> dict[str, int]:
    """The reservation as the response's row keeps it."""
    return {
        "tokens": reservation.tokens,
        "minute": reservation.minute,
        "period": reservation.period,
    }


def held_reservation(key_id: int, request: dict[str, Any]) -> QuotaReservation | None:
    """The reservation a response's row keeps (None: its key had no quota)."""
    held = request.get("reservation")
    if not isinstance(held, dict):
        return None
    return QuotaReservation(key_id, int(held["tokens"]), int(held["minute"]), int(held["period"]))


def release(deps: Deps, caller: Caller, model: str, reservation: QuotaReservation | None) -> None:
    """Give back the tokens of a response that was not created after all."""
    if reservation is not None:
        outcome = RequestOutcome(error=True, status=400)
        deps.accountant.done(caller.key_id, model, reservation, outcome, usage=False)
