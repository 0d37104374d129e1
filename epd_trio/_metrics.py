"""What the proxy counts about its traffic: the Prometheus metrics and each request's trace.

One ``ProxyMetrics`` per ``Proxy`` owns every metric; nothing else touches prometheus_client. The
proxy calls it at a few named points: per request ``begin`` / ``replied`` / ``failed`` /
``finish``; per upstream call ``attempt`` / ``attempt_done`` / ``upstream_failed``; and on the
events ``retried``, ``client_cancelled``, ``kv_missing``, ``encoded``, ``health_changed``. The
same calls fill the request's ``RequestTrace``, which ``finish`` turns into the request log line
when that is enabled (``_logs.py``).

Registries. In one process (``hypercorn epd_trio.app:app``, ``epd-trio serve`` with one worker,
the apps tests start in-process) each ``ProxyMetrics`` has its own ``CollectorRegistry``: several
apps in one process never clash, as they would on the global default registry. With several
worker processes the numbers must add up whichever worker answers the scrape, so
prometheus_client's multiprocess mode is used when ``PROMETHEUS_MULTIPROC_DIR`` is set (it must be
set before prometheus_client is imported; ``epd-trio serve --workers N`` creates a private
directory and passes it to its workers): each process writes its values to its own memory-mapped
files there and a scrape merges the files of all processes. Counters and histograms add up;
gauges need a rule (``multiprocess_mode``): in-flight requests are ``livesum`` (the sum over live
workers: a dead worker's requests died with it) and instance health is ``livemin`` (each worker
probes on its own; 0 as soon as one live worker has the instance out of rotation).

Cost (README "Operations"): labelled children are resolved once per (role, instance), rank,
stage, endpoint and outcome and kept in dicts, so the hot path is a dict lookup and a few float
additions per call, never ``.labels()``. ``metrics=False`` (``EPD_METRICS``) swaps every metric for
a no-op and turns ``/metrics`` off; the trace is still kept for the request log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from ._errors import ProxyError, UpstreamError
from ._health import InstanceState
from ._routing import Instance
from ._trace import Attempt, RequestTrace, outcome_of, request_fields

log = logging.getLogger("epd_trio")
request_log = logging.getLogger("epd_trio.requests")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds; prefill of a long prompt and a long generation take minutes, so the buckets go to 10.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
STAGES = ("encode", "prefill", "decode")

#: The request the current task works for: lets the per-attempt hooks (called from the failover
#: loop and the encoder fan-out's child tasks, which inherit the context) add to its trace
#: without threading it through every call. Set by ``begin``; each request runs in its own task.
_current: ContextVar[RequestTrace | None] = ContextVar("epd_trio_request_trace", default=None)


class _Off:
    """Stands in for every metric and child when metrics are disabled."""

    def labels(self, *_: Any) -> _Off:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


_OFF = _Off()


class _InstanceMetrics:
    """The cached children of one (role, instance)."""

    __slots__ = ("errors", "in_flight", "ranks", "requests")

    def __init__(self, requests: Any, errors: Any, in_flight: Any) -> None:
        self.requests = requests
        self.errors = errors
        self.in_flight = in_flight
        self.ranks: dict[int, Any] = {}


class ProxyMetrics:
    """The metrics of one proxy (see the module docstring for who calls what)."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        request_log: bool = False,
        instances: Iterable[InstanceState] = (),
    ) -> None:
        self.enabled = enabled
        self.request_log = request_log
        self.multiprocess = enabled and bool(os.environ.get(MULTIPROC_ENV))
        self.registry: CollectorRegistry | None = None
        target: CollectorRegistry | None = None
        if enabled:
            self.registry = CollectorRegistry(auto_describe=True)
            if self.multiprocess:
                MultiProcessCollector(self.registry)  # values live in the files, not here
            else:
                target = self.registry

        def metric(kind: type, name: str, doc: str, labels: Sequence[str] = (),
                   **kwargs: Any) -> Any:
            if not enabled:
                return _OFF
            return kind(name, doc, labels, registry=target, **kwargs)

        buckets = {"buckets": LATENCY_BUCKETS}
        self._requests = metric(Counter, "epd_trio_requests",
                                "Client requests by endpoint and outcome", ["endpoint", "outcome"])
        self._duration = metric(
            Histogram, "epd_trio_request_duration_seconds",
            "Successful requests: body received to last byte handed to the server",
            ["endpoint", "stream"], **buckets)
        self._ttfb = metric(
            Histogram, "epd_trio_time_to_first_byte_seconds",
            "Replies: body received to first response bytes ready (a stream: first token)",
            ["endpoint", "stream"], **buckets)
        self._stage = metric(
            Histogram, "epd_trio_stage_duration_seconds",
            "Successful upstream calls by stage (decode: until its first body bytes)",
            ["stage"], **buckets)
        self._upstream_requests = metric(Counter, "epd_trio_upstream_requests",
                                         "Upstream calls sent, retries included",
                                         ["role", "instance"])
        self._upstream_errors = metric(Counter, "epd_trio_upstream_errors",
                                       "Failed upstream calls (transport, timeout, 5xx)",
                                       ["role", "instance"])
        self._in_flight = metric(Gauge, "epd_trio_upstream_in_flight",
                                 "Upstream calls and streams open now", ["role", "instance"],
                                 multiprocess_mode="livesum")
        self._healthy = metric(Gauge, "epd_trio_instance_healthy",
                               "1 while the instance is in rotation", ["role", "instance"],
                               multiprocess_mode="livemin")
        self._evictions = metric(Counter, "epd_trio_instance_evictions",
                                 "Times the instance left the rotation", ["role", "instance"])
        self._ranks = metric(Counter, "epd_trio_dp_rank_requests",
                             "Upstream calls per data-parallel rank (instances with dp_size > 1)",
                             ["role", "instance", "rank"])
        self._items = metric(Counter, "epd_trio_encoder_items",
                             "Media items encoded, per encoder", ["instance"])
        self._retries = metric(Counter, "epd_trio_retries",
                               "Failovers: upstream attempts after the first, by stage", ["stage"])
        self._cancels = metric(Counter, "epd_trio_client_cancellations",
                               "Requests abandoned by their client, by the stage they were in",
                               ["stage"])
        self._kv_missing = metric(Counter, "epd_trio_prefill_kv_transfer_params_missing",
                                  "Prefill answers without kv_transfer_params (decode recomputed)")
        # Children cached by label values (see "Cost" above).
        self._per_instance: dict[tuple[str, str], _InstanceMetrics] = {}
        #: The instances in the roster now (``set_members``).
        self._members: set[tuple[str, str]] = set()
        self._per_request: dict[tuple[str, str], Any] = {}
        self._per_reply: dict[tuple[str, bool], tuple[Any, Any]] = {}
        self._per_stage = {stage: (self._stage.labels(stage), self._retries.labels(stage),
                                   self._cancels.labels(stage)) for stage in STAGES}
        self.set_members(instances)

    # -- children ------------------------------------------------------------------------------
    def _instance(self, role: str, url: str) -> _InstanceMetrics:
        found = self._per_instance.get((role, url))
        if found is None:
            found = self._per_instance[role, url] = _InstanceMetrics(
                self._upstream_requests.labels(role, url), self._upstream_errors.labels(role, url),
                self._in_flight.labels(role, url))
        return found

    def set_members(self, states: Iterable[InstanceState]) -> None:
        """Follow the instances in the roster (configured and registered; not on the hot path).

        A newcomer shows in ``/metrics`` at once (zero counts, its health). An instance that left
        loses its series in one process; with several workers prometheus-client cannot delete a
        series from the other workers' files, so its counts stay and its health reads 0.
        """
        # Membership is kept apart from the children cache: a request still running on an
        # instance that left re-creates its children, and must not make the instance look like
        # a member when it registers again (its health would never be set).
        current = {(state.role, state.url): state for state in states}
        for key, state in current.items():
            if key not in self._members:
                self._members.add(key)
                self._instance(*key)
                self._healthy.labels(*key).set(1 if state.live else 0)
        for key in [key for key in self._members | self._per_instance.keys() if key not in current]:
            self._members.discard(key)
            counts = self._per_instance.pop(key, None)
            if self.multiprocess or not self.enabled:
                self._healthy.labels(*key).set(0)
                continue
            for family in (self._upstream_requests, self._upstream_errors, self._in_flight,
                           self._healthy, self._evictions):
                with contextlib.suppress(KeyError):
                    family.remove(*key)
            for rank in counts.ranks if counts is not None else ():
                with contextlib.suppress(KeyError):
                    self._ranks.remove(*key, str(rank))

    def in_flight(self, role: str, url: str) -> Any:
        """The in-flight gauge of an instance (a stream relayed after its first bytes)."""
        return self._instance(role, url).in_flight

    # -- per request ---------------------------------------------------------------------------
    def begin(self, endpoint: str, request_id: str) -> RequestTrace:
        """A request arrived (its body is read); it becomes the current task's request."""
        trace = RequestTrace(request_id, endpoint, time.perf_counter())
        _current.set(trace)
        return trace

    def replied(self, trace: RequestTrace) -> None:
        """The reply's first bytes are ready (a stream: decode's first chunk is here)."""
        trace.first_byte = time.perf_counter()
        trace.status = 200
        self._reply_histograms(trace)[0].observe(trace.first_byte - trace.started)

    def _reply_histograms(self, trace: RequestTrace) -> tuple[Any, Any]:
        """The (time to first byte, duration) children for the request's endpoint and kind."""
        found = self._per_reply.get((trace.endpoint, trace.stream))
        if found is None:
            stream = "true" if trace.stream else "false"
            found = self._per_reply[trace.endpoint, trace.stream] = (
                self._ttfb.labels(trace.endpoint, stream),
                self._duration.labels(trace.endpoint, stream))
        return found

    def failed(self, trace: RequestTrace, stage: str, exc: BaseException) -> None:
        """The request ended without a reply: cancelled (in ``stage``) or an error."""
        if isinstance(exc, trio.Cancelled):
            self.client_cancelled(stage, trace)
        elif isinstance(exc, ProxyError):
            trace.outcome, trace.status, trace.error = outcome_of(exc), exc.status, exc.message
            if isinstance(exc, UpstreamError) and exc.status >= 500:
                log.warning("request %s failed: %s", trace.request_id, exc.message,
                            extra={"fields": {"request_id": trace.request_id,
                                              "stage": exc.stage, "instance": exc.instance}})
        else:
            trace.outcome, trace.status, trace.error = "internal_error", 500, repr(exc)

    def stream_failed(self, trace: RequestTrace, error: UpstreamError) -> None:
        """A relayed stream broke after its first byte (the client got an SSE error event)."""
        trace.outcome, trace.error = "stream_error", error.message
        log.warning("request %s: stream broke after its first byte: %s", trace.request_id,
                    error.message, extra={"fields": {"request_id": trace.request_id,
                                                     "stage": error.stage,
                                                     "instance": error.instance}})

    def rejected(self, endpoint: str, error: ProxyError) -> None:
        """A request refused before it reached the pipeline (a bad key, a body over the limit)."""
        self._requests.labels(endpoint, outcome_of(error)).inc()

    def client_cancelled(self, stage: str, trace: RequestTrace) -> None:
        self._per_stage[stage][2].inc()
        trace.outcome, trace.status, trace.cancelled_stage = "cancelled", 499, stage

    def finish(self, trace: RequestTrace) -> None:
        """The request is over (response sent, or the client gone): count it, maybe log it."""
        finished = time.perf_counter()
        outcome = trace.outcome or "ok"
        child = self._per_request.get((trace.endpoint, outcome))
        if child is None:
            child = self._per_request[trace.endpoint, outcome] = self._requests.labels(
                trace.endpoint, outcome)
        child.inc()
        if outcome == "ok":
            self._reply_histograms(trace)[1].observe(finished - trace.started)
        if self.request_log and request_log.isEnabledFor(logging.INFO):
            fields = request_fields(trace, finished)
            request_log.info("%s %s %s %d in %.1f ms", trace.request_id, trace.endpoint,
                             fields["outcome"], trace.status, fields["duration_s"] * 1000,
                             extra={"fields": fields})

    # -- per upstream call ---------------------------------------------------------------------
    def attempt(self, stage: str, instance: Instance, rank: int | None) -> Attempt:
        """An upstream call is sent (``attempt_done`` must follow)."""
        counts = self._instance(stage, instance.url)
        counts.requests.inc()
        counts.in_flight.inc()
        if rank is not None:
            child = counts.ranks.get(rank)
            if child is None:
                child = counts.ranks[rank] = self._ranks.labels(stage, instance.url, str(rank))
            child.inc()
        attempt = Attempt(stage, instance.url, rank, time.perf_counter(), handle=counts)
        trace = _current.get()
        if trace is not None:
            trace.attempts.append(attempt)
        return attempt

    def attempt_done(self, attempt: Attempt, outcome: str) -> None:
        """The call answered (``ok``: its stage latency is observed), failed, or was abandoned."""
        attempt.seconds = time.perf_counter() - attempt.started
        attempt.outcome = outcome
        attempt.handle.in_flight.dec()
        if outcome == "ok":
            self._per_stage[attempt.stage][0].observe(attempt.seconds)

    def upstream_failed(self, role: str, url: str) -> None:
        """An instance failed a call in a way that is its own fault (not a 4xx)."""
        self._instance(role, url).errors.inc()

    # -- events --------------------------------------------------------------------------------
    def retried(self, stage: str, instance: Instance, error: UpstreamError) -> None:
        """A failover: ``stage`` failed at ``instance`` and is retried elsewhere."""
        self._per_stage[stage][1].inc()
        trace = _current.get()
        if trace is not None:
            trace.retries += 1
        log.warning("retrying %s after failure at %s: %s", stage, instance.url, error.message,
                    extra={"fields": {"request_id": trace and trace.request_id, "stage": stage,
                                      "instance": instance.url}})

    def kv_missing(self) -> None:
        self._kv_missing.inc()
        trace = _current.get()
        if trace is not None:
            trace.kv_missing = True

    def encoded(self, calls: Iterable[Any]) -> None:
        """The encode stage succeeded: count each ``EncoderCall``'s items at its encoder."""
        for call in calls:
            self._items.labels(call.instance.url).inc(len(call.item_indices))

    def health_changed(self, state: InstanceState) -> None:
        """Listener for ``Registry.on_change`` (not on the request path)."""
        self._healthy.labels(state.role, state.url).set(1 if state.live else 0)
        if not state.live:
            self._evictions.labels(state.role, state.url).inc()

    # -- reading -------------------------------------------------------------------------------
    def exposition(self) -> bytes | None:
        """The Prometheus text format of every metric (all workers'); None when disabled."""
        return None if self.registry is None else generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (all workers'), 0 when absent: for tests and tools."""
        if self.registry is None:
            return 0.0
        return self.registry.get_sample_value(name, labels) or 0.0

    def by_stage(self, name: str) -> dict[str, float]:
        """A per-stage counter's non-zero values, e.g. ``by_stage("epd_trio_retries_total")``."""
        values = {stage: self.value(name, stage=stage) for stage in STAGES}
        return {stage: value for stage, value in values.items() if value}

    @property
    def retries(self) -> dict[str, float]:
        return self.by_stage("epd_trio_retries_total")

    @property
    def client_cancels(self) -> dict[str, float]:
        return self.by_stage("epd_trio_client_cancellations_total")
