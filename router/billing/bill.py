"""One request's bill: what it is charged when it ends, settled once.

The API layer (router/api/openai.py) makes a ``RequestBill`` once the key's
quota reservation holds; the request carries it (``Call.bill``) through the
admission queue (router/admission/) and the proxy (router/forwarding/proxy.py),
which report how the request ended: ``failed`` (an error, nothing generated
billed), ``answered`` (a whole answer, with the engine's usage), ``abandoned``
(a client that left before the answer: its reservation, the most the engine
may have generated) or ``settle`` (a stream's outcome, counted as relayed).
The first report settles the bill; later ones do nothing, so every path may
report without knowing whether another already did.
"""

import time
from collections.abc import Callable
from dataclasses import replace

from opentelemetry.trace import Span, StatusCode

from router.billing.accounting import Accountant, RequestOutcome
from router.billing.quotas import QuotaReservation
from router.common.metrics import Metrics


class Bill:
    """A request's end, reported once: ``then`` hooks learn the outcome.

    ``prompt_estimate`` is billed as the prompt when a stream ends before the
    engine's usage; ``reserved`` (the prompt estimate and every token the
    request may generate) when the client leaves a request whose generated
    tokens cannot be known.
    """

    def __init__(self, prompt_estimate: int = 0, reserved: int = 0) -> None:
        self.prompt_estimate = prompt_estimate
        self.reserved = reserved
        self.outcome: RequestOutcome | None = None  # once settled
        self._hooks: list[Callable[[RequestOutcome], None]] = []

    def then(self, hook: Callable[[RequestOutcome], None]) -> None:
        """Call ``hook`` with the outcome once the bill is settled (after the charge)."""
        self._hooks.append(hook)

    def settle(self, outcome: RequestOutcome) -> None:
        """The request is over with ``outcome``: charge it (the first time only)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self._charge(outcome)
        for hook in self._hooks:
            hook(outcome)

    def failed(self, status: int) -> None:
        """The request failed with ``status``: no tokens billed, the reservation released."""
        self.settle(RequestOutcome(error=True, status=status))

    def answered(self, outcome: RequestOutcome, client_left: bool = False) -> None:
        """A whole answer came; a client gone meanwhile (the engine finished
        regardless) is billed what was generated, as gone (499)."""
        self.settle(replace(outcome, error=True, status=499) if client_left else outcome)

    def abandoned(self) -> None:
        """Given up on when the client left before the answer: the prompt
        estimate, and the rest of the reservation as generated (the most the
        engine could have)."""
        completion = max(0, self.reserved - self.prompt_estimate)
        self.settle(RequestOutcome(self.prompt_estimate, completion, error=True, status=499))

    def _charge(self, outcome: RequestOutcome) -> None:
        """What settling does beyond the hooks (nothing here: see ``RequestBill``)."""


class RequestBill(Bill):
    """The bill of a request the router serves: settling releases an
    on-demand adapter's use (``release``), ends the request's span, queues its
    usage and the reservation's settlement, and counts it in the metrics."""

    def __init__(
        self,
        accountant: Accountant,
        metrics: Metrics,
        key_id: int,
        model: str,
        endpoint: str,
        reservation: QuotaReservation | None,
        span: Span,
        started: float,
        prompt_estimate: int = 0,
        reserved: int = 0,
        bill_usage: bool = True,
    ) -> None:
        super().__init__(prompt_estimate, reserved)
        # False: the caller bills the usage (X-Llmgw-Billed-By-Caller); the
        # quota reservation is settled all the same.
        self._bill_usage = bill_usage
        self._accountant = accountant
        self._metrics = metrics
        self._key_id = key_id
        self._model = model
        self._endpoint = endpoint
        self._reservation = reservation
        self._span = span
        self._started = started
        # An on-demand adapter's use, released when the request is over.
        self.release: Callable[[], None] | None = None

    def _charge(self, outcome: RequestOutcome) -> None:
        if self.release is not None:
            self.release()
        end_span(self._span, outcome)
        self._accountant.done(
            self._key_id, self._model, self._reservation, outcome, usage=self._bill_usage
        )
        self._metrics.request_done(
            self._endpoint,
            self._model,
            outcome.status,
            time.monotonic() - self._started,
            outcome.prompt_tokens,
            outcome.completion_tokens,
        )


def end_span(span: Span, outcome: RequestOutcome) -> None:
    """Write a request's outcome on its span and end it."""
    span.set_attribute("http.response.status_code", outcome.status)
    span.set_attribute("llmgw.prompt_tokens", outcome.prompt_tokens)
    span.set_attribute("llmgw.completion_tokens", outcome.completion_tokens)
    if outcome.cached_tokens is not None:  # engine-reported (cache-aware routing)
        span.set_attribute("llmgw.route.cached_tokens", outcome.cached_tokens)
    if outcome.error:
        span.set_status(StatusCode.ERROR)
    span.end()
