"""A small OTLP/HTTP trace receiver: what a collector sees of the proxy's spans, decoded.

No collector package exists on the machines this project runs on, so the tests (and the
tracing bench) receive the real exporter's output here: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in protobuf (gzip or not), decoded with ``opentelemetry-proto``
(the ``otel`` extra) into plain ``ReceivedSpan`` values. It answers 200 with an empty
``ExportTraceServiceResponse``, as a collector does.

It runs on a thread (stdlib ``ThreadingHTTPServer``), so it serves exporters in other
processes (``epd-trio serve --workers 2``) and in this one alike; ``wait_for`` blocks until a
condition on the spans holds (call it through ``trio.to_thread.run_sync`` from trio code).
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived (ids in lower-case hex, as in ``traceparent``)."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    return None if kind is None else getattr(any_value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode_export(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest`` (protobuf bytes)."""
    request = ExportTraceServiceRequest.FromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    name=span.name, kind=_KINDS.get(span.kind, str(span.kind)),
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                    status=_STATUS.get(span.status.code, str(span.status.code)),
                    attributes=_attributes(span.attributes), resource=resource,
                    scope=scope_spans.scope.name))
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` serves on 127.0.0.1 (``receiver.endpoint``) until
    the block ends; ``receiver.spans`` is every span received so far."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spans: list[ReceivedSpan] = []
        #: Export requests received (each a batch), and those that failed to decode.
        self.exports = 0
        self.rejected = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                encoding = (self.headers.get("content-encoding") or "").lower()
                try:
                    if self.path != TRACES_PATH:
                        raise ValueError(self.path)  # noqa: TRY301
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    spans = decode_export(body)
                except Exception:
                    with receiver._changed:
                        receiver.rejected += 1
                    self.send_response(400)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                with receiver._changed:
                    receiver.exports += 1
                    receiver.spans.extend(spans)
                    receiver._changed.notify_all()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver",
                                        daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """The base URL to give as ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float) -> bool:
        """Block until ``condition(spans)`` holds (True), or ``timeout`` seconds (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: condition(self.spans), timeout)
