"""A minimal OTLP/HTTP trace receiver for tests: what llmgw processes export.

It decodes each ``ExportTraceServiceRequest`` (protobuf) into flat span
records, so tests can check trace ids and parent links across processes.
"""

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object] = field(default_factory=dict)
    events: tuple[tuple[str, dict[str, object]], ...] = ()


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: object) -> dict[str, object]:
    return {kv.key: _value(kv.value) for kv in pairs}  # type: ignore[attr-defined]


class OtlpReceiver:
    """Listens on 127.0.0.1:<port>/v1/traces until closed."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output quiet

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes=_attributes(span.attributes),
                            events=tuple((e.name, _attributes(e.attributes)) for e in span.events),
                        )
                    )
        with self._lock:
            self.spans += found

    def snapshot(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        """Stop listening."""
        self._server.shutdown()
        self._server.server_close()
