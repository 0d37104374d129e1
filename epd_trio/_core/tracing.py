"""OpenTelemetry tracing, the pure part: when it is on, W3C trace context, and span attributes.

Tracing is off unless an OTLP endpoint is configured, with the variables every OpenTelemetry
SDK reads (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER`` / ``_ARG``): an operator
who already runs a collector sets nothing of ours. ``tracing_settings`` reads them; the SDK
itself (an optional extra) is only imported by ``_observe/tracing.py`` once this says tracing is on.

Even with tracing off the proxy forwards the client's ``traceparent`` / ``tracestate`` to every
leg (``client_context``), so vLLM's own ``llm_request`` spans still join the client's trace.

Attributes follow the OpenTelemetry semantic conventions **v1.44.0**: HTTP (stable) for the
SERVER span and the CLIENT spans, GenAI (development) for the model and the token usage; names
the conventions lack are under ``epd_trio.``, and two are vLLM's own (``gen_ai.request.id``,
``gen_ai.latency.time_to_first_token``), so a query joins the proxy's spans to vLLM's.

No I/O and no OpenTelemetry import here: values in, values out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .config import ConfigError
from .trace import Attempt, RequestTrace
from .urls import check_base_url

#: The sampler when ``OTEL_TRACES_SAMPLER`` is unset: a client's sampled trace is followed, and
#: one request in ten of those that start a trace here is sampled (each costs CPU: the
#: observability how-to gives the measured figure).
DEFAULT_SAMPLER = "parentbased_traceidratio"
DEFAULT_RATIO = 0.1
DEFAULT_SERVICE_NAME = "epd-trio"
#: Seconds the shutdown waits for the last spans to be exported.
SHUTDOWN_FLUSH_TIMEOUT = 5.0
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
#: The one export protocol the proxy ships an exporter for.
PROTOCOL = "http/protobuf"
SEMCONV_VERSION = "1.44.0"

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
#: W3C: at most 32 list members of at most 256 characters each; a longer header is dropped.
_MAX_TRACESTATE = 32 * 257


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Whether spans are recorded and exported, and how they are sampled."""

    enabled: bool = False
    service_name: str = DEFAULT_SERVICE_NAME
    sampler: str = DEFAULT_SAMPLER
    ratio: float = DEFAULT_RATIO
    #: Where spans go (for the start-up line; the exporter reads the variables itself).
    endpoint: str = ""


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "false"):
        return False
    if value == "true":
        return True
    raise ConfigError(name, f"must be true or false, got {value!r}")


def tracing_settings(env: Mapping[str, str]) -> TracingSettings:
    """Tracing's settings from the standard OpenTelemetry variables in ``env``.

    On when an OTLP endpoint is set (the traces one or the generic one), unless
    ``OTEL_SDK_DISABLED=true``. A sampler name outside the specification's list, a ratio
    outside [0, 1] or an export protocol other than ``http/protobuf`` is a ``ConfigError``:
    the SDK would warn and fall back, and a proxy started with a typo should not quietly trace
    everything or nothing.
    """
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    generic = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    endpoint = traces or (generic.rstrip("/") + "/v1/traces" if generic else "")
    if _flag(env, "OTEL_SDK_DISABLED") or not endpoint:
        return TracingSettings()
    try:  # checked like every URL here; a user and password are the SDK's, and never shown
        check_base_url(traces or generic, what="OTLP endpoint", userinfo=True)
    except ValueError as exc:
        raise ConfigError("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" if traces
                          else "OTEL_EXPORTER_OTLP_ENDPOINT", str(exc)) from None
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip()
        if protocol:
            if protocol != PROTOCOL:
                raise ConfigError(name, f"epd_trio exports OTLP over {PROTOCOL} only, got "
                                  f"{protocol!r}")
            break
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or DEFAULT_SAMPLER
    if sampler not in SAMPLERS:
        raise ConfigError("OTEL_TRACES_SAMPLER", f"unknown sampler {sampler!r}; one of "
                          + ", ".join(SAMPLERS))
    # The specification's default ratio is 1.0; ours applies only to our default sampler.
    ratio = 1.0 if env.get("OTEL_TRACES_SAMPLER", "").strip() else DEFAULT_RATIO
    raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if raw and sampler.endswith("traceidratio"):
        try:
            ratio = float(raw)
        except ValueError:
            raise ConfigError("OTEL_TRACES_SAMPLER_ARG", f"not a number: {raw!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError("OTEL_TRACES_SAMPLER_ARG", f"a ratio in [0, 1], got {ratio:g}")
    service = env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME
    return TracingSettings(enabled=True, service_name=service, sampler=sampler, ratio=ratio,
                           endpoint=endpoint)


# -- W3C trace context ----------------------------------------------------------------------------
def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, flags)`` of a valid ``traceparent`` header, else None.

    As the W3C spec says: version ``ff`` and all-zero ids are invalid; a version 00 header with
    anything after the flags is invalid; a later version may carry more fields."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if version == "00" and rest:
        return None
    return int(trace_id, 16), int(span_id, 16), int(flags, 16)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def client_context(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """The trace headers a leg forwards from the client: a valid ``traceparent`` (re-formatted
    as version 00, the one this proxy speaks) and its ``tracestate``; nothing for a missing
    or malformed ``traceparent`` (a ``tracestate`` alone means nothing)."""
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return {}
    headers = {"traceparent": format_traceparent(*parsed)}
    state = (tracestate or "").strip()
    if state and len(state) <= _MAX_TRACESTATE and state.isascii() and state.isprintable():
        headers["tracestate"] = state
    return headers


# -- what the spans say ---------------------------------------------------------------------------
#: gen_ai.operation.name by endpoint path.
OPERATION_OF_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def usage_of(data: bytes) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from an OpenAI answer: a JSON body, or the tail
    of an SSE stream (``stream_options.include_usage``: the last event before ``[DONE]``
    carries ``usage``); None when the answer reports none."""
    start = data.rfind(b'"usage"')
    if start < 0:
        return None
    candidates = [data]
    line_start = data.rfind(b"data:", 0, start)
    if line_start >= 0:  # an SSE event: its JSON runs to the end of its line
        end = data.find(b"\n", start)
        candidates.insert(0, data[line_start + 5:end if end >= 0 else len(data)])
    for candidate in candidates:
        try:
            parsed = orjson.loads(candidate)
        except orjson.JSONDecodeError:
            continue
        usage = parsed.get("usage") if isinstance(parsed, dict) else None
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                return prompt, completion
    return None


def leg_outcome(attempt: Attempt, trace: RequestTrace) -> str:
    """How a leg ended, as its span says it: ``ok``, ``error``, ``stream_error``,
    ``cancelled`` (a sibling failed, or a failover abandoned it) or ``client_gone``."""
    outcome = attempt.outcome or "cancelled"
    if attempt.client_gone or (outcome == "cancelled" and trace.cancelled_stage is not None):
        return "client_gone"
    if outcome == "ok" and attempt.stream_error:
        return "stream_error"
    return outcome


def leg_attributes(attempt: Attempt, trace: RequestTrace, path: str) -> dict[str, Any]:
    """A CLIENT span's attributes, read when the request ends (its outcome is known then)."""
    host, _, port = attempt.instance.removeprefix("http://").removeprefix(
        "https://").partition("/")[0].rpartition(":")
    attributes: dict[str, Any] = {
        "http.request.method": "POST",
        "url.full": attempt.instance.rstrip("/") + path + (
            "/render" if attempt.stage == "render" else ""),
        "server.address": host or attempt.instance,
        "epd_trio.stage": attempt.stage,
        "epd_trio.upstream": attempt.instance,
        "epd_trio.attempt": attempt.number,
        "http.request.resend_count": attempt.number - 1,
        "epd_trio.outcome": leg_outcome(attempt, trace),
    }
    if port.isdigit():
        attributes["server.port"] = int(port)
    if attempt.rank is not None:
        attributes["epd_trio.dp_rank"] = attempt.rank
    if attempt.status is not None:
        attributes["http.response.status_code"] = attempt.status
    if attempt.error_type is not None:
        attributes["error.type"] = attempt.error_type
    return attributes


def request_attributes(trace: RequestTrace) -> dict[str, Any]:
    """The SERVER span's attributes, when the request ends."""
    attributes: dict[str, Any] = {
        "http.request.method": "POST",
        "http.route": trace.endpoint,
        "url.path": trace.endpoint,
        "http.response.status_code": trace.status,
        "gen_ai.operation.name": OPERATION_OF_PATH.get(trace.endpoint, "chat"),
        "gen_ai.request.id": trace.request_id,
        "epd_trio.outcome": trace.outcome or "ok",
        "epd_trio.stream": trace.stream,
        "epd_trio.retries": trace.retries,
    }
    if trace.model is not None:
        attributes["gen_ai.request.model"] = trace.model
    if trace.first_byte is not None:
        attributes["gen_ai.latency.time_to_first_token"] = round(
            trace.first_byte - trace.started, 6)
    if trace.usage is not None:
        attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"] = \
            trace.usage
    if trace.outcome not in (None, "ok"):
        attributes["error.type"] = trace.outcome
    if trace.cancelled_stage is not None:
        attributes["epd_trio.cancelled_stage"] = trace.cancelled_stage
    if trace.kv_missing:
        attributes["epd_trio.kv_transfer_params_missing"] = True
    return attributes
