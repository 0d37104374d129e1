"""OpenTelemetry spans for client requests: one SERVER span per request, one CLIENT span per leg.

Off by default (``_core/tracing.tracing_settings``). Off, ``Tracing`` only forwards the client's
``traceparent`` / ``tracestate`` to every leg, so vLLM's spans join the client's trace. On,
``OtelTracing`` records the spans with the SDK (the optional extra ``epd-trio[otel]``, imported
here only then) and exports them over OTLP/HTTP from the ``BatchSpanProcessor``'s own thread.

Why explicit spans, and no current-span context: a relayed stream's body is closed from
another task than the one that opened it, and attaching a context there fails ("Failed to
detach context"). So nothing here touches the OpenTelemetry context: every span is created
with its parent given explicitly, and each leg's ``traceparent`` is formatted from its own
CLIENT span (vLLM's ``llm_request`` then nests under the leg that called it). The spans'
attributes are set once, when the request ends (``_core/tracing``): a leg's outcome, a client
gone for one, is only known then; each span keeps its own start and end time.

Cost: an unsampled request records nothing; its legs forward the SERVER span's (unsampled)
``traceparent``. One ``OtelTracing`` (one tracer provider) per app, so one per worker process of
``epd-trio serve``; ``aclose`` exports what is left, within ``SHUTDOWN_FLUSH_TIMEOUT``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from importlib import metadata
from types import MappingProxyType
from typing import Any, Protocol

import trio

from .._core.config import ConfigError
from .._core.trace import Attempt, RequestTrace
from .._core.tracing import (
    SEMCONV_VERSION,
    SHUTDOWN_FLUSH_TIMEOUT,
    TracingSettings,
    format_traceparent,
    leg_attributes,
    parse_traceparent,
    request_attributes,
    tracing_settings,
)
from .._core.urls import redact_url

log = logging.getLogger("epd_trio")

#: What a leg adds to its headers (empty: nothing).
TraceHeaders = Mapping[str, str]
_NONE: TraceHeaders = MappingProxyType({})
#: A request without trace headers.
NO_TRACE_CONTEXT = _NONE


class RequestSpans(Protocol):
    """One client request's tracing: the headers of each leg, and the end of the request."""

    #: Whether this request's spans are recorded (worth reading its usage for).
    recording: bool

    def leg_headers(self, attempt: Attempt) -> TraceHeaders: ...

    def end(self, trace: RequestTrace, finished: float) -> None: ...


class _Forwarding:
    """Nothing recorded; every leg carries the same trace headers (the client's, or those of
    an unsampled SERVER span)."""

    __slots__ = ("headers",)
    recording = False

    def __init__(self, headers: TraceHeaders) -> None:
        self.headers = headers

    def leg_headers(self, attempt: Attempt) -> TraceHeaders:
        return self.headers

    def end(self, trace: RequestTrace, finished: float) -> None:
        pass


_NOTHING = _Forwarding(_NONE)


class Tracing:
    """Tracing off: the client's trace context goes to every leg, nothing is recorded."""

    enabled = False

    def begin(self, endpoint: str, client: TraceHeaders, started: float) -> RequestSpans:
        """A request arrived (``started``: its ``perf_counter()``); ``client``: its trace
        headers (``_core.tracing.client_context``)."""
        return _Forwarding(client) if client else _NOTHING

    async def aclose(self) -> None:
        pass


class TracingUnavailable(ConfigError):
    """Tracing is switched on, but the OpenTelemetry SDK is not installed."""


def create_tracing(env: Mapping[str, str], exporter: Any = None) -> Tracing:
    """The app's tracing from the OpenTelemetry variables in ``env``; ``exporter`` replaces the
    OTLP exporter (tests pass an in-memory one, which also switches tracing on).

    Raises ``ConfigError`` for a bad variable, ``TracingUnavailable`` when tracing is on and
    the ``otel`` extra is missing."""
    settings = tracing_settings(env)
    if exporter is not None and not settings.enabled:
        settings = TracingSettings(enabled=True, sampler="always_on", ratio=1.0)
    if not settings.enabled:
        return Tracing()
    return OtelTracing(settings, exporter)


def check_tracing(env: Mapping[str, str]) -> TracingSettings:
    """Tracing's settings, checked before any worker starts: a bad variable, or tracing on
    without the SDK, is a ``ConfigError`` (``TracingUnavailable``) naming the fix."""
    settings = tracing_settings(env)
    if settings.enabled:
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError as exc:
            raise TracingUnavailable(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                f"tracing is on, but the OpenTelemetry SDK is missing ({exc.name}): "
                "pip install 'epd-trio[otel]', or set OTEL_SDK_DISABLED=true") from None
    return settings


class OtelTracing(Tracing):
    """Tracing on: spans recorded by the OpenTelemetry SDK (see the module docstring)."""

    enabled = True

    def __init__(self, settings: TracingSettings, exporter: Any = None) -> None:
        variable = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" if exporter is None
                    else "OTEL_TRACES_EXPORTER")
        try:
            from opentelemetry import trace as api
            from opentelemetry.context import Context
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider, sampling
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingUnavailable(
                variable, f"tracing is on, but the OpenTelemetry SDK is missing ({exc.name}): "
                "pip install 'epd-trio[otel]', or set OTEL_SDK_DISABLED=true") from None
        self.settings = settings
        ratio = settings.ratio
        samplers = {
            "always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "traceidratio": sampling.TraceIdRatioBased(ratio),
            "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
            "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
            "parentbased_traceidratio": sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
        }
        self.provider = TracerProvider(
            # The pid tells the workers of ``epd-trio serve --workers N`` apart.
            resource=Resource.create({"service.name": settings.service_name,
                                      "process.pid": os.getpid()}),
            sampler=samplers[settings.sampler], shutdown_on_exit=False)
        if exporter is None:
            exporter = OTLPSpanExporter()  # endpoint, headers, timeout: the OTEL_* variables
            self._processor: Any = BatchSpanProcessor(exporter)
            log.info("tracing on: OTLP/HTTP to %s, sampler %s (ratio %g), service %s",
                     redact_url(settings.endpoint), settings.sampler, ratio, settings.service_name)
        else:  # a test's in-memory exporter: each span there as soon as it ends
            self._processor = SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(self._processor)
        self.tracer = self.provider.get_tracer(
            "epd_trio", _version(), schema_url=f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}")
        self._api = api
        #: The empty context: a span started in it is a root span (never the ambient one).
        self._empty = Context()
        self._server, self._client = api.SpanKind.SERVER, api.SpanKind.CLIENT
        self._error = api.Status(api.StatusCode.ERROR)
        self._remote = (NonRecordingSpan, SpanContext, TraceFlags, TraceState)
        self._closed = False

    def _parent(self, client: TraceHeaders) -> Any:
        """The context a request's SERVER span starts in: the client's span, or none."""
        parsed = parse_traceparent(client.get("traceparent"))
        if parsed is None:
            return self._empty
        non_recording, span_context, flags, state = self._remote
        trace_id, span_id, trace_flags = parsed
        state_header = client.get("tracestate")
        parent = non_recording(span_context(
            trace_id, span_id, is_remote=True, trace_flags=flags(trace_flags & 1),
            trace_state=state.from_header([state_header]) if state_header else None))
        return self._api.set_span_in_context(parent, self._empty)

    def begin(self, endpoint: str, client: TraceHeaders, started: float) -> RequestSpans:
        offset = time.time_ns() - int(time.perf_counter() * 1e9)
        span = self.tracer.start_span(f"POST {endpoint}", context=self._parent(client),
                                      kind=self._server, start_time=offset + int(started * 1e9),
                                      record_exception=False, set_status_on_exception=False)
        state = client.get("tracestate")
        if not span.is_recording():
            context = span.get_span_context()
            headers = {"traceparent": format_traceparent(context.trace_id, context.span_id,
                                                          context.trace_flags)}
            if state:
                headers["tracestate"] = state
            return _Forwarding(headers)
        return _Recording(self, span, offset, state)

    async def aclose(self) -> None:
        """Export the spans still queued, within ``SHUTDOWN_FLUSH_TIMEOUT`` (a collector that
        is down must not hold the shutdown)."""
        if self._closed:
            return
        self._closed = True
        timeout = SHUTDOWN_FLUSH_TIMEOUT
        # The SDK's own shutdown waits up to 30 s, plus the exporter's retries: run it in a
        # thread, and stop waiting at the deadline (its threads are daemons: exit goes on).
        with trio.move_on_after(timeout) as scope:
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("tracing: the last spans were not exported within %g s", timeout)


def _version() -> str:
    """The installed package's version (the tracer's; not ``epd_trio.__version__``, whose
    import would close a cycle through this module)."""
    try:
        return metadata.version("epd-trio")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Recording:
    """A sampled request: its SERVER span, and a CLIENT span per leg."""

    __slots__ = ("_legs", "_offset", "_parent", "_span", "_state", "_tracing")
    recording = True

    def __init__(self, tracing: OtelTracing, span: Any, offset: int, state: str | None) -> None:
        self._tracing = tracing
        self._span = span
        self._offset = offset
        self._state = state
        self._parent = tracing._api.set_span_in_context(span, tracing._empty)
        self._legs: list[tuple[Attempt, Any]] = []

    def leg_headers(self, attempt: Attempt) -> TraceHeaders:
        tracing = self._tracing
        span = tracing.tracer.start_span(
            attempt.stage, context=self._parent, kind=tracing._client,
            start_time=self._offset + int(attempt.started * 1e9), record_exception=False,
            set_status_on_exception=False)
        self._legs.append((attempt, span))
        context = span.get_span_context()
        headers = {"traceparent": format_traceparent(context.trace_id, context.span_id,
                                                      context.trace_flags)}
        if self._state:
            headers["tracestate"] = self._state
        return headers

    def end(self, trace: RequestTrace, finished: float) -> None:
        offset, error = self._offset, self._tracing._error
        for attempt, span in self._legs:
            attributes = leg_attributes(attempt, trace, trace.endpoint)
            span.set_attributes(attributes)
            if attributes["epd_trio.outcome"] in ("error", "stream_error"):
                span.set_status(error)
            end = attempt.ended
            if end is None:
                end = finished if attempt.seconds is None else attempt.started + attempt.seconds
            span.end(end_time=offset + int(end * 1e9))
        span = self._span
        span.set_attributes(request_attributes(trace))
        if trace.status >= 500 or trace.outcome == "stream_error":
            span.set_status(error)
        span.end(end_time=offset + int(finished * 1e9))

