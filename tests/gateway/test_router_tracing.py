"""The router's span per request, and the trace context it hands the engine."""

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.gateway_util import Gateway, auth, gateway, ready, spec

M = "traced"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()


@pytest.fixture
async def traced(tmp_path: Path, exporter: InMemorySpanExporter) -> AsyncIterator[Gateway]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with gateway(
        tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)],
        tracer=provider.get_tracer("test"),
    ) as g:  # fmt: skip
        yield g


def _chat(**extra: object) -> dict[str, object]:
    return {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


@pytest.mark.parametrize("stream", [False, True])
async def test_one_span_per_request_continued_by_the_engine(
    traced: Gateway, exporter: InMemorySpanExporter, stream: bool
) -> None:
    key_id, key = traced.key()
    headers = auth(key) | {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    r = await traced.http.post("/v1/chat/completions", json=_chat(stream=stream), headers=headers)
    assert r.status_code == 200, r.text
    [span] = exporter.get_finished_spans()
    assert span.name == "POST /v1/chat/completions"
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE
    assert span.parent is not None and format(span.parent.span_id, "016x") == CLIENT_SPAN
    attrs = dict(span.attributes or {})
    assert attrs["llmgw.model"] == M and attrs["llmgw.replica"] == "r1"
    assert attrs["llmgw.key_id"] == key_id and attrs["llmgw.stream"] == stream
    assert attrs["http.response.status_code"] == 200 and attrs["llmgw.completion_tokens"] == 3
    assert key not in json.dumps(attrs)  # the key id, never the key
    # The engine continues the router's span.
    sent = traced.engine.seen[-1].headers["traceparent"]
    assert sent == f"00-{CLIENT_TRACE}-{format(span.context.span_id, '016x')}-01"


async def test_a_refused_request_is_a_failed_span(
    traced: Gateway, exporter: InMemorySpanExporter
) -> None:
    _, key = traced.key(rpm=1)
    first = await traced.http.post("/v1/chat/completions", json=_chat(), headers=auth(key))
    assert first.status_code == 200
    refused = await traced.http.post("/v1/chat/completions", json=_chat(), headers=auth(key))
    assert refused.status_code == 429
    spans = exporter.get_finished_spans()
    assert [dict(s.attributes or {})["http.response.status_code"] for s in spans] == [200, 429]
    assert spans[1].status.status_code.name == "ERROR"


async def test_tracing_off_sends_no_trace_headers(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)]) as g:
        _, key = g.key()
        headers = auth(key) | {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        r = await g.http.post("/v1/chat/completions", json=_chat(), headers=headers)
        assert r.status_code == 200
        sent = g.engine.seen[-1].headers
        assert "traceparent" not in sent and "tracestate" not in sent
