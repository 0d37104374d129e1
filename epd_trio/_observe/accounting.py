"""Every count an upstream leg feeds, in one place: health, Prometheus, the request's trace.

The pipeline reports to one ``RequestAccount`` per client request (made by ``Accounting.begin``)
and to nothing else: ``leg(stage, slot)`` wraps each upstream call, ``retried`` each failover,
and a handful of request events (``replied``, ``failed``, ``finish``...) its end. The account
carries the request's ``RequestTrace`` itself, so nothing travels in a context variable and a
child task of the encoder fan-out reports to the same account as its parent.

The account also knows the request's **stage**: the stage of the last leg opened, recorded as
the leg opens. A cancellation (the client left before the reply) is counted by it. Why here and
not in the pipeline: the legs are where a request moves from stage to stage, so the stage
cannot drift from them (it was a variable the pipeline set by hand in seven places). The one
exception is a leg that runs *beside* the one the client waits on (MoRIIO WRITE's prefill,
concurrent with its decode): it is opened with ``beside=True`` and leaves the stage alone.

Why one object and not hooks per caller: an attempt's in-flight count, its health verdict, its
metrics and its trace entry must move together. When they were kept by a failover hook for two
stages, by a context manager for the third and by hand for a stream, the three drifted (a
stream's in-flight count was kept twice). A relayed stream is the one leg that outlives its
call: ``Leg.hold()`` keeps it in flight until the request's resources release it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from .._core.errors import (
    ModelNotFound,
    ProxyError,
    ShuttingDown,
    UpstreamError,
    UpstreamStatusError,
)
from .._core.failover import Slot, is_retryable
from .._core.health import InstanceState, Registry
from .._core.names import Stage
from .._core.routing import Instance
from .._core.trace import Attempt, AttemptNumbers, RequestTrace, outcome_of
from .._core.tracing import usage_of
from .metrics import ProxyMetrics
from .request_log import log_request, log_retry, log_stream_failure, log_upstream_failure
from .tracing import NO_TRACE_CONTEXT, RequestSpans, TraceHeaders, Tracing


class Accounting:
    """The proxy's side of the accounting: its health registry, its metrics, its tracing."""

    def __init__(self, registry: Registry, metrics: ProxyMetrics, *, request_log: bool,
                 tracing: Tracing | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.request_log = request_log
        #: The shutdown grace period is over: a request cancelled from now on was cut by the
        #: shutdown, not left by its client (``_web/drain``).
        self.shutting_down = False
        #: OpenTelemetry (off by default: it then only forwards the client's trace context).
        self.tracing = tracing if tracing is not None else Tracing()

    def begin(self, endpoint: str, request_id: str,
              trace_context: TraceHeaders = NO_TRACE_CONTEXT) -> RequestAccount:
        """A request arrived (its body is read); ``trace_context``: the client's trace headers
        (``_core.tracing.client_context``)."""
        started = time.perf_counter()
        return RequestAccount(self, RequestTrace(request_id, endpoint, started),
                              self.tracing.begin(endpoint, trace_context, started))

    def refused(self, endpoint: str, request_id: str, started: float,
                error: ProxyError, tenant: str | None = None) -> None:
        """A request refused before its body reached the pipeline (a bad key, the admission
        cap, a body over the limit or too slow, another method): counted under its outcome and
        logged like any other request, so a refusal is as visible as an answer. No span:
        nothing went upstream. ``started``: its ``perf_counter()`` on arrival; ``tenant``:
        its tenant, when fair admission named it (its wait is then the line's duration)."""
        self.metrics.rejected(endpoint, error)
        if self.request_log:
            trace = RequestTrace(request_id, endpoint, started, tenant=tenant)
            trace.outcome, trace.status, trace.error = (outcome_of(error), error.status,
                                                        error.message)
            log_request(trace, time.perf_counter())

    def left_early(self, endpoint: str, request_id: str, started: float) -> None:
        """The client left before its body was complete: nobody to answer, but the request
        is counted and logged (``cancelled``, 499) like one that left later."""
        self.metrics.request_done(endpoint, "cancelled")
        if self.request_log:
            trace = RequestTrace(request_id, endpoint, started)
            trace.outcome, trace.status = "cancelled", 499
            trace.error = "the client left before its body was complete"
            log_request(trace, time.perf_counter())

    def count_failure(self, state: InstanceState, error: UpstreamError) -> None:
        """An upstream failure at ``state``'s instance: its error count, and its health."""
        if is_retryable(error):  # a 4xx is the client's fault, not the instance's
            state.errors += 1
            self.metrics.instance(state.stage, state.url).errors.inc()
        if error.instance_failure:
            self.registry.failed(state, down=error.instance_down)


class Leg:
    """One upstream call, counted in flight until ``release`` (at the end of its ``leg`` block,
    unless ``hold`` kept it open for a relayed stream)."""

    __slots__ = ("_account", "_attempt", "_counts", "_released", "_state", "held",
                 "trace_headers")

    def __init__(self, account: RequestAccount, state: InstanceState, counts: Any,
                 attempt: Attempt, trace_headers: TraceHeaders) -> None:
        self._account = account
        self._state = state
        self._counts = counts
        self._attempt = attempt
        self._released = False
        self.held = False
        #: What this leg's request adds to its headers: its own ``traceparent`` (tracing on),
        #: the client's (off), or nothing.
        self.trace_headers = trace_headers

    def traced(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` (the leg's own, a fresh dict) with the leg's trace headers."""
        if self.trace_headers:
            headers.update(self.trace_headers)
        return headers

    def answered(self, status: int) -> None:
        """The instance answered with ``status`` (for the leg's span)."""
        self._attempt.status = status

    def hold(self) -> Callable[[], None]:
        """Keep the call in flight past its block; returns the ``release`` to call later."""
        self.held = True
        return self.release

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._state.in_flight -= 1
            self._counts.in_flight.dec()
            if self.held:  # a relayed stream is over: its span ends now, not at its first bytes
                self._attempt.ended = time.perf_counter()

    def client_left(self) -> None:
        """The client left while this leg's stream was relayed to it."""
        if self._account.acc.shutting_down:
            self._account.shut_down()
            return
        self._attempt.client_gone = True
        self._account.client_cancelled(self._attempt.stage)

    def stream_failed(self, error: ProxyError) -> None:
        """The relayed stream broke after its first byte (the client got an SSE error event),
        or the shutdown ended it (``ShuttingDown``: not the instance's fault)."""
        if isinstance(error, ShuttingDown):
            self._account.shut_down()
            return
        assert isinstance(error, UpstreamError)
        self._account.acc.count_failure(self._state, error)
        self._attempt.stream_error = True
        trace = self._account.trace
        trace.outcome, trace.error = "stream_error", error.message
        log_stream_failure(trace, error)


class RequestAccount:
    """One client request's accounting (a ``LegObserver`` for the stages)."""

    __slots__ = ("_numbers", "acc", "spans", "stage", "trace")

    def __init__(self, acc: Accounting, trace: RequestTrace, spans: RequestSpans) -> None:
        self.acc = acc
        self.trace = trace
        #: The request's spans (or, tracing off, the trace headers its legs forward).
        self.spans = spans
        #: Each leg's attempt number (failovers and re-runs show in its span).
        self._numbers = AttemptNumbers()
        #: The stage the client waits on: the last leg's, set as it opens (the first stage
        #: until then).
        self.stage: Stage = "encode"

    @contextmanager
    def leg(self, stage: Stage, slot: Slot, *, beside: bool = False) -> Iterator[Leg]:
        """Count one upstream call: in flight while it runs, its outcome fed to health.

        The request is in ``stage`` from now on, unless the leg runs ``beside`` the one the
        client waits on (which then keeps the stage)."""
        if not beside:
            self.stage = stage
        instance, rank = slot
        acc, url = self.acc, instance.url
        state = acc.registry.state_for(stage, instance)
        state.in_flight += 1
        state.sent += 1
        counts = acc.metrics.instance(stage, url)
        counts.requests.inc()
        counts.in_flight.inc()
        if rank is not None:
            acc.metrics.rank(counts, stage, url, rank).inc()
        attempt = Attempt(stage, url, rank, time.perf_counter(), number=self._numbers.take(stage))
        self.trace.attempts.append(attempt)
        leg = Leg(self, state, counts, attempt, self.spans.leg_headers(attempt))
        outcome = "cancelled"
        try:
            yield leg
        except UpstreamError as error:
            outcome = "error"
            if isinstance(error, UpstreamStatusError):
                attempt.status = error.upstream_status
                attempt.error_type = str(error.upstream_status)
            else:
                attempt.error_type = type(error).__name__
            acc.count_failure(state, error)
            raise
        else:
            outcome = "ok"
            acc.registry.succeeded(state)
        finally:
            attempt.seconds = time.perf_counter() - attempt.started
            attempt.outcome = outcome
            if outcome == "ok":
                acc.metrics.stage_seconds(stage).observe(attempt.seconds)
            if not leg.held:
                leg.release()

    @contextmanager
    def render(self, instance: Instance) -> Iterator[TraceHeaders]:
        """The render call of KV routing: an attempt of its own (stage ``render``: its span,
        its line in the request log), whose failure is no failure of the instance (a render
        that fails routes the request by ``cache_aware``). Yields the trace headers it carries."""
        attempt = Attempt("render", instance.url, None, time.perf_counter())
        self.trace.attempts.append(attempt)
        outcome = "cancelled"
        try:
            yield self.spans.leg_headers(attempt)
            outcome = "ok"
        except UpstreamError as error:
            outcome = "error"
            attempt.error_type = (str(error.upstream_status)
                                  if isinstance(error, UpstreamStatusError)
                                  else type(error).__name__)
            raise
        finally:
            attempt.seconds = time.perf_counter() - attempt.started
            attempt.outcome = outcome

    def retried(self, stage: str, instance: Instance, error: UpstreamError) -> None:
        """A failover: ``stage`` failed at ``instance`` and is retried elsewhere."""
        self.acc.metrics.retried(stage)
        trace = self.trace
        trace.retries += 1
        for attempt in reversed(trace.attempts):
            if attempt.stage == stage and attempt.instance == error.instance:
                self._numbers.failed_over(stage, attempt.number)
                break
        log_retry(trace, stage, instance, error)

    def read_usage(self, data: bytes) -> None:
        """The answer (a JSON body, or a stream's tail): its token usage, for a recorded
        span (nobody reads it otherwise, so it is not parsed)."""
        if self.spans.recording:
            self.trace.usage = usage_of(data)

    def prefill_bypassed(self) -> None:
        """This attempt goes to decode alone (it holds the prompt: ``EPD_PD_UNCACHED_TOKEN_
        THRESHOLD``)."""
        self.acc.metrics.prefill_bypassed()
        self.trace.prefill_bypassed = True

    def kv_decided(self, stage: str, trust: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A slot of ``stage`` was chosen on the KV index (its trust state and cached tokens)."""
        self.acc.metrics.kv_decision(stage, trust, prompt_tokens, cached_tokens)
        trace = self.trace
        trace.prompt_tokens = prompt_tokens
        if trace.kv_decisions is None:
            trace.kv_decisions = {}
        trace.kv_decisions[stage] = (trust, cached_tokens)

    def kv_missing(self) -> None:
        """Prefill answered without ``kv_transfer_params`` (decode recomputes the prefill)."""
        self.acc.metrics.kv_missing()
        self.trace.kv_missing = True

    def encoded(self, calls: Iterable[Any]) -> None:
        """The encode stage succeeded: count each ``EncoderCall``'s items at its encoder."""
        self._numbers.encoded()
        for call in calls:
            self.acc.metrics.encoded(call.instance.url, len(call.item_indices))

    def replied(self) -> None:
        """The reply's first bytes are ready (a stream: decode's first chunk is here)."""
        trace = self.trace
        trace.first_byte = time.perf_counter()
        trace.status = 200
        ttfb, _ = self.acc.metrics.reply_histograms(trace.endpoint, trace.stream, trace.pool or "")
        ttfb.observe(trace.first_byte - trace.started)

    def client_cancelled(self, stage: str) -> None:
        self.acc.metrics.client_cancelled(stage)
        trace = self.trace
        trace.outcome, trace.status, trace.cancelled_stage = "cancelled", 499, stage

    def shut_down(self, status: int | None = None) -> None:
        """The shutdown ended the request (its grace period was over): counted and logged as
        ``shutdown``, not as a client that left. ``status``: the 503 sent, if the reply had not
        started (a stream keeps its 200 and ends with an error event)."""
        trace = self.trace
        trace.outcome, trace.error = "shutdown", "the proxy shut down before the request ended"
        if status is not None:
            trace.status = status

    def failed(self, exc: BaseException) -> None:
        """The request ended without a reply: cancelled (in its ``stage``) or an error."""
        trace = self.trace
        if isinstance(exc, trio.Cancelled) and self.acc.shutting_down:
            self.shut_down(ShuttingDown.status)
        elif isinstance(exc, trio.Cancelled):
            self.client_cancelled(self.stage)
        elif isinstance(exc, ProxyError):
            trace.outcome, trace.status, trace.error = outcome_of(exc), exc.status, exc.message
            if isinstance(exc, ModelNotFound):
                self.acc.metrics.model_not_found()
            if isinstance(exc, UpstreamError) and exc.status >= 500:
                log_upstream_failure(trace, exc)
        else:
            trace.outcome, trace.status, trace.error = "internal_error", 500, repr(exc)

    def finish(self) -> None:
        """The request is over (response sent, or the client gone): count it, maybe log it."""
        finished = time.perf_counter()
        trace = self.trace
        outcome = trace.outcome or "ok"
        metrics = self.acc.metrics
        pool = trace.pool or ""
        metrics.request_done(trace.endpoint, outcome, pool)
        if outcome == "ok":
            metrics.reply_histograms(trace.endpoint, trace.stream, pool)[1].observe(
                finished - trace.started)
        if self.acc.request_log:
            log_request(trace, finished)
        self.spans.end(trace, finished)
