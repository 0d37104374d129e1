"""What happened to one client request: the record behind its metrics and its log line (no I/O).

A ``RequestTrace`` is filled while the request runs (one ``Attempt`` per upstream call: stage,
instance, DP rank, timing, outcome) and read once when it ends. Keeping it plain data means the
log line's content and the outcome classification are tested with plain asserts, and the proxy
pays one small object per request and per upstream attempt, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import (
    BadRequest,
    NoInstance,
    ProxyError,
    ProxyOverloaded,
    UpstreamError,
    UpstreamTimeout,
)

#: Values of the ``outcome`` label of ``epd_trio_requests_total`` (docs/how-to/operations.md).
OUTCOMES = ("ok", "client_error", "upstream_error", "timeout", "overloaded", "no_instance",
            "stream_error", "cancelled", "internal_error")


@dataclass(slots=True, eq=False)
class Attempt:
    """One upstream call of a request (a retry is another ``Attempt``)."""

    stage: str
    instance: str
    rank: int | None
    #: ``time.perf_counter()`` when it was sent.
    started: float
    #: Seconds until it answered (a stream: until its first body bytes); None while running.
    seconds: float | None = None
    #: ``ok``, ``error`` (the instance failed or refused), or ``cancelled`` (abandoned).
    outcome: str | None = None
    #: 1 for the stage's first call of the request, 2 for the next one (a failover, or a
    #: prefill re-run for a decode retry)...; an encoder sub-request counts its own.
    number: int = 1
    #: The instance's HTTP status, when it answered.
    status: int | None = None
    #: What failed (``error.type`` of its span): the error's class, or the HTTP status.
    error_type: str | None = None
    #: A relayed stream that broke after its first byte.
    stream_error: bool = False
    #: A relayed stream whose client left before it ended.
    client_gone: bool = False
    #: ``time.perf_counter()`` when a relayed stream was over (its last byte relayed, its
    #: client gone, or it broke): the end of its span. None for any other call, which ends at
    #: ``started + seconds`` (``seconds`` keeps measuring the first bytes, as the latency
    #: metric and the decode timeout do).
    ended: float | None = None


@dataclass(slots=True, eq=False)
class RequestTrace:
    """One client request, from the proxy's point of view."""

    request_id: str
    endpoint: str
    started: float
    stream: bool = False
    attempts: list[Attempt] = field(default_factory=list)
    retries: int = 0
    #: Prefill answered without ``kv_transfer_params`` (decode recomputed the prefill).
    kv_missing: bool = False
    #: ``perf_counter()`` when the reply's first bytes were ready (None: no reply yet).
    first_byte: float | None = None
    #: None until something other than success happened (see ``OUTCOMES``).
    outcome: str | None = None
    status: int = 200
    error: str | None = None
    #: The stage the client left in, when it did.
    cancelled_stage: str | None = None
    #: The client's ``model`` (None until the body is parsed).
    model: str | None = None
    #: ``(prompt_tokens, completion_tokens)`` when the answer reported them and it was read
    #: for a sampled trace.
    usage: tuple[int, int] | None = None


def outcome_of(error: ProxyError) -> str:
    """The ``outcome`` label for a request that failed with ``error`` before its first byte."""
    if isinstance(error, ProxyOverloaded):
        return "overloaded"
    if isinstance(error, NoInstance):
        return "no_instance"
    if isinstance(error, UpstreamTimeout):
        return "timeout"
    if isinstance(error, BadRequest) or error.status < 500:
        return "client_error"  # includes a 4xx answer relayed from an instance
    if isinstance(error, UpstreamError):
        return "upstream_error"
    return "internal_error"


def layout_of(trace: RequestTrace) -> str | None:
    """The layout this request ran, from the stages it reached: ``E+P+D``, ``E+PD``, ``P+D``,
    ``PD``; None when it reached no instance (refused, or no instance to send it to).

    A request without media skips the encoders, so it is ``P+D`` even on an E+P+D proxy.
    """
    stages = {a.stage for a in trace.attempts}
    if not stages:
        return None
    serving = "P+D" if "prefill" in stages else "PD"
    return f"E+{serving}" if "encode" in stages else serving


def stage_seconds(trace: RequestTrace) -> dict[str, float]:
    """Wall time per stage: from its first attempt's start to its last attempt's end."""
    spans: dict[str, tuple[float, float]] = {}
    for a in trace.attempts:
        if a.seconds is None:
            continue
        end = a.started + a.seconds
        first, last = spans.get(a.stage, (a.started, end))
        spans[a.stage] = (min(first, a.started), max(last, end))
    return {stage: round(last - first, 6) for stage, (first, last) in spans.items()}


def request_fields(trace: RequestTrace, finished: float) -> dict[str, Any]:
    """The content of the request's structured log line (JSON-ready)."""
    fields: dict[str, Any] = {
        "request_id": trace.request_id,
        "endpoint": trace.endpoint,
        "stream": trace.stream,
        "layout": layout_of(trace),
        "outcome": trace.outcome or "ok",
        "status": trace.status,
        "duration_s": round(finished - trace.started, 6),
        "ttfb_s": (None if trace.first_byte is None
                   else round(trace.first_byte - trace.started, 6)),
        "stages_s": stage_seconds(trace),
        "attempts": [
            {"stage": a.stage, "instance": a.instance, "rank": a.rank,
             "start_s": round(a.started - trace.started, 6),
             "seconds": None if a.seconds is None else round(a.seconds, 6),
             "outcome": a.outcome or "running"}
            for a in trace.attempts
        ],
        "retries": trace.retries,
    }
    if trace.kv_missing:
        fields["kv_transfer_params_missing"] = True
    if trace.cancelled_stage is not None:
        fields["cancelled_stage"] = trace.cancelled_stage
    if trace.error is not None:
        fields["error"] = trace.error
    return fields
