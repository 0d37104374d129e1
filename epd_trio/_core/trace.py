"""What happened to one client request: the record behind its metrics and its log line (no I/O).

A ``RequestTrace`` is filled while the request runs (one ``Attempt`` per upstream call: stage,
instance, DP rank, timing, outcome) and read once when it ends. Keeping it plain data means the
log line's content and the outcome classification are tested with plain asserts, and the proxy
pays one small object per request and per upstream attempt, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from .errors import (
    BadRequest,
    NoInstance,
    ProxyError,
    ProxyOverloaded,
    RateLimited,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
)

#: Values of the ``outcome`` label of ``epd_trio_requests_total`` (docs/how-to/operations.md).
OUTCOMES = ("ok", "client_error", "rate_limited", "upstream_error", "timeout", "overloaded",
            "no_instance", "stream_error", "cancelled", "shutdown", "internal_error")


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
    #: How many times its stage has been tried for the client request, this call included
    #: (``AttemptNumbers`` applies the rule): 1, then 2 for a failover, a prefill or encode
    #: re-run for a decode retry, a decode re-run after a MoRIIO WRITE prefill failover...
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


class AttemptNumbers:
    """The attempt number of each leg of one client request (``Attempt.number``).

    The rule: a leg's number is how many times its stage has been tried for the request, this
    leg included. Prefill and decode make one call per try, so each of their legs takes the
    next number, whatever caused it: a failover within the stage, a prefill re-run for a
    decode retry (its KV handle belonged to the failed decode), a decode re-run after a MoRIIO
    WRITE prefill failover. The encoder sub-requests sent together are one try of the encode
    stage, so each takes the try's number (1 the first time); a sub-request failed over is
    that sub-request's next try (its number + 1); and the stage re-run for a decode retry is
    numbered after every encode leg before it.

    Why per stage and not per request: a span's ``epd_trio.attempt`` then says how often that
    stage was asked, which is what an operator reading a failover wants; the request's own
    count of failovers is ``RequestTrace.retries``.
    """

    __slots__ = ("_encode_highest", "_encode_retry", "_next")

    def __init__(self) -> None:
        #: The number of a stage's next leg (1 when absent).
        self._next: dict[str, int] = {}
        #: The number of the next encode leg when it is a sub-request's failover (0: none).
        self._encode_retry = 0
        self._encode_highest = 0

    def take(self, stage: str) -> int:
        """The number of a leg of ``stage`` that starts now."""
        if stage == "encode":
            number = self._encode_retry or self._next.get(stage, 1)
            self._encode_retry = 0
            self._encode_highest = max(self._encode_highest, number)
            return number
        number = self._next.get(stage, 1)
        self._next[stage] = number + 1
        return number

    def failed_over(self, stage: str, failed: int) -> None:
        """``stage`` is retried elsewhere after its leg numbered ``failed`` failed.

        Only an encoder sub-request needs telling: its retry is the next encode leg to start
        (``with_failover`` starts it with no checkpoint in between, so no sibling's leg can
        take the number), numbered ``failed + 1``."""
        if stage == "encode":
            self._encode_retry = failed + 1

    def encoded(self) -> None:
        """The encode stage succeeded: a re-run of it (a decode retry) is its next try."""
        self._next["encode"] = self._encode_highest + 1


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
    #: Routed on the KV index: ``{stage: (the chosen slot's trust state, its cached tokens)}``,
    #: and the prompt's tokens (0: no lookup, or none in time).
    kv_decisions: dict[str, tuple[str, int]] | None = None
    prompt_tokens: int = 0
    #: Decode alone: its slot held all but EPD_PD_UNCACHED_TOKEN_THRESHOLD of the prompt.
    prefill_bypassed: bool = False
    #: ``perf_counter()`` when the reply's first bytes were ready (None: no reply yet).
    first_byte: float | None = None
    #: None until something other than success happened (see ``OUTCOMES``).
    outcome: str | None = None
    status: int = 200
    error: str | None = None
    #: The stage the client left in, when it did.
    cancelled_stage: str | None = None
    #: The client's ``model`` (None until the body is parsed, or when it named none).
    model: str | None = None
    #: The model pool the request went to: a configured or learned name (an alias's target,
    #: ``*`` for the any-name pool), so a bounded ``model`` label; None before it was found.
    pool: str | None = None
    #: ``(prompt_tokens, completion_tokens)`` when the answer reported them and it was read
    #: for a sampled trace.
    usage: tuple[int, int] | None = None
    #: Fair admission: the request's tenant, its effective priority, and the seconds it
    #: waited for a place before its trace started (None without tenants; a request refused
    #: at admission has its tenant only, its wait being its whole duration).
    tenant: str | None = None
    priority: int | None = None
    queued: float | None = None


def outcome_of(error: ProxyError) -> str:
    """The ``outcome`` label for a request that failed with ``error`` before its first byte."""
    if isinstance(error, ShuttingDown):
        return "shutdown"
    if isinstance(error, ProxyOverloaded):
        return "overloaded"
    if isinstance(error, NoInstance):
        return "no_instance"
    if isinstance(error, UpstreamTimeout):
        return "timeout"
    if isinstance(error, RateLimited):
        return "rate_limited"  # a tenant over its own limit: the operator's rule, not a bad body
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
    if trace.kv_decisions:
        fields["kv_index"] = {"prompt_tokens": trace.prompt_tokens, **{
            stage: {"trust": trust, "cached_tokens": tokens}
            for stage, (trust, tokens) in trace.kv_decisions.items()}}
    if trace.prefill_bypassed:
        fields["prefill_bypassed"] = True
    if trace.model is not None:
        fields["model"] = trace.model
    if trace.pool is not None and trace.pool != trace.model:
        fields["pool"] = trace.pool  # an alias's target, or the one model of a nameless body
    if trace.tenant is not None:
        fields["tenant"] = trace.tenant
    if trace.priority is not None:
        fields["priority"] = trace.priority
    if trace.queued is not None:
        fields["queued_s"] = round(trace.queued, 6)
    if trace.cancelled_stage is not None:
        fields["cancelled_stage"] = trace.cancelled_stage
    if trace.error is not None:
        fields["error"] = trace.error
    return fields


def text_value(value: Any) -> str:
    """``value`` as the text log writes it: a plain word bare, anything else as a JSON string.

    A client chooses its ``x-request-id``: written raw, an id holding a space, a quote, an
    ``=`` or a newline would read as more words, another ``key=value`` pair or another line.
    Quoted, it is one token a reader can parse back (the JSON format needs none of this)."""
    if isinstance(value, str) and value and value.isprintable() and not any(
            c in value for c in ' "='):
        return value
    return orjson.dumps(value, default=str).decode()
