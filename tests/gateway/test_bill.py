"""A request's bill (router/billing/bill.py): settled by the first report of
how the request ended, whichever path makes it; the charge is the usage and
quota settlement queued, the request counted, and the hooks after."""

from pathlib import Path

from opentelemetry import trace

from llmgw.store import Store
from router.billing import usage
from router.billing.accounting import Accountant, RequestOutcome
from router.billing.bill import Bill, RequestBill
from router.common.metrics import Metrics
from router.control_link.routing import RoutingTable


def test_the_first_report_settles_the_bill_and_later_ones_do_nothing() -> None:
    seen: list[RequestOutcome] = []
    bill = Bill(prompt_estimate=10, reserved=100)
    bill.then(seen.append)
    bill.failed(502)
    bill.answered(RequestOutcome(5, 7))
    bill.abandoned()
    assert seen == [RequestOutcome(error=True, status=502)]
    assert bill.outcome == seen[0]


def test_what_each_end_bills() -> None:
    def ended(report: str) -> RequestOutcome | None:
        bill = Bill(prompt_estimate=10, reserved=100)
        if report == "answered":
            bill.answered(RequestOutcome(5, 7))
        elif report == "answered, client gone":
            bill.answered(RequestOutcome(5, 7), client_left=True)
        elif report == "abandoned":
            bill.abandoned()
        return bill.outcome

    assert ended("answered") == RequestOutcome(5, 7)
    # The engine finished for a client that left: what it generated, as gone.
    assert ended("answered, client gone") == RequestOutcome(5, 7, error=True, status=499)
    # Given up on: the prompt estimate and the rest of the reservation.
    assert ended("abandoned") == RequestOutcome(10, 90, error=True, status=499)
    assert ended("none yet") is None


async def test_a_request_bill_charges_once_then_runs_its_hooks(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    accountant = Accountant(store)
    metrics = Metrics(RoutingTable())
    order: list[str] = []
    bill = RequestBill(
        accountant, metrics, 7, "m", "chat/completions", None, trace.INVALID_SPAN, 0.0, 10, 100
    )
    bill.release = lambda: order.append("adapter released")

    def hook(outcome: RequestOutcome) -> None:
        # Runs after the charge: the request is already counted.
        counted = metrics.registry.get_sample_value(
            "llmgw_requests_total", {"endpoint": "chat/completions", "model": "m", "status": "200"}
        )
        order.append(f"hook saw {counted} counted, {outcome.completion_tokens} tokens")

    bill.then(hook)
    bill.answered(RequestOutcome(3, 4))
    bill.failed(500)  # a late report: nothing more
    assert order == ["adapter released", "hook saw 1.0 counted, 4 tokens"]
    await accountant.flush()
    rows = usage.query(store, key_id=7)
    assert [(r.model, r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        ("m", 1, 3, 4)
    ]
