"""The Prometheus metrics of one proxy: the only module that touches prometheus_client.

One ``ProxyMetrics`` per ``Proxy`` owns every metric family and hands out their cached children;
``_observe/accounting.py`` decides what to count when (it is the one caller on the request path), the
request's trace and its log line live in ``_core/trace.py`` and ``_observe/request_log.py``.

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

Cost (docs/discussion/performance.md): labelled children are resolved once per (stage, instance), rank,
stage, endpoint and outcome and kept in dicts, so the hot path is a dict lookup and a few float
additions per call, never ``.labels()``. ``metrics=False`` (``EPD_METRICS``) swaps every metric for
a no-op and turns ``/metrics`` off; the trace is still kept for the request log.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from .._core.errors import AtCapacity, ProxyError
from .._core.health import InstanceState
from .._core.names import STAGES
from .._core.trace import outcome_of

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The KV index's trust states, as its metrics and ``GET /instances`` name them.
TRUST_STATES = ("exact", "degraded", "fallback")

# No ``*_created`` series: one per counter and histogram child, they double the series count and
# say only when the process started counting, which ``process_start_time_seconds`` already does.
# (prometheus-client's switch is process-wide; this module is its only user here.)
disable_created_metrics()
#: Seconds; prefill of a long prompt and a long generation take minutes, so the buckets go to 10.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)

#: Seconds of a render call (bounded by EPD_RENDER_TIMEOUT, 0.5 s by default).
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Seconds of the proxy's own lookup: tens of microseconds.
DECISION_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3)


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

    def remove(self, *_: Any) -> None:
        return None

    def observe(self, amount: float) -> None:
        pass


_OFF = _Off()


class _InstanceMetrics:
    """The cached children of one (stage, instance)."""

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
        instances: Iterable[InstanceState] = (),
        shared_state: bool = False,
        kv_index: bool = False,
        tenants: bool = False,
    ) -> None:
        """``shared_state``: export the state store's metrics (only with ``EPD_STATE_URL``);
        ``kv_index``: the KV index's and the render call's (only when a policy or the prefill
        bypass reads the index); ``tenants``: fair admission's, per tenant and band (only with
        ``EPD_TENANTS`` or ``EPD_TENANT_HEADER``)."""
        self.enabled = enabled
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
                                "Client requests by endpoint, outcome and model pool",
                                ["endpoint", "outcome", "model"])
        self._duration = metric(
            Histogram, "epd_trio_request_duration_seconds",
            "Successful requests: body received to last byte handed to the server",
            ["endpoint", "stream", "model"], **buckets)
        self._ttfb = metric(
            Histogram, "epd_trio_time_to_first_byte_seconds",
            "Replies: body received to first response bytes ready (a stream: first token)",
            ["endpoint", "stream", "model"], **buckets)
        self._stage = metric(
            Histogram, "epd_trio_stage_duration_seconds",
            "Successful upstream calls by stage (decode: until its first body bytes)",
            ["stage"], **buckets)
        self._upstream_requests = metric(Counter, "epd_trio_upstream_requests",
                                         "Upstream calls sent, retries included",
                                         ["role", "upstream"])
        self._upstream_errors = metric(Counter, "epd_trio_upstream_errors",
                                       "Failed upstream calls (transport, timeout, 5xx)",
                                       ["role", "upstream"])
        self._in_flight = metric(Gauge, "epd_trio_upstream_in_flight",
                                 "Upstream calls and streams open now", ["role", "upstream"],
                                 multiprocess_mode="livesum")
        self._healthy = metric(Gauge, "epd_trio_instance_healthy",
                               "1 while the instance is in rotation", ["role", "upstream"],
                               multiprocess_mode="livemin")
        self._evictions = metric(Counter, "epd_trio_instance_evictions",
                                 "Times the instance left the rotation", ["role", "upstream"])
        self._ranks = metric(Counter, "epd_trio_dp_rank_requests",
                             "Upstream calls per data-parallel rank (instances with dp_size > 1)",
                             ["role", "upstream", "rank"])
        self._items = metric(Counter, "epd_trio_encoder_items",
                             "Media items encoded, per encoder", ["upstream"])
        self._retries = metric(Counter, "epd_trio_retries",
                               "Failovers: upstream attempts after the first, by stage", ["stage"])
        self._cancels = metric(Counter, "epd_trio_client_cancellations",
                               "Requests abandoned by their client, by the stage they were in",
                               ["stage"])
        self._kv_missing = metric(Counter, "epd_trio_prefill_kv_transfer_params_missing",
                                  "Prefill answers without kv_transfer_params (decode recomputed)")
        self._unknown_model = metric(
            Counter, "epd_trio_model_not_found",
            "Requests for a name no pool, alias or any-name instance serves (no name label: "
            "clients choose it)")
        self._alias_picks = metric(Counter, "epd_trio_alias_picks",
                                   "Requests for an alias, by the target it went to",
                                   ["alias", "target"])
        self._pool_complete = metric(
            Gauge, "epd_trio_model_pool_complete",
            "1 while every stage the model needs has a live instance in its pool",
            ["model"], multiprocess_mode="livemin")
        self._pools_shown: set[str] = set()
        self._refused = metric(Counter, "epd_trio_admission_refusals",
                               "Client requests refused at EPD_MAX_INFLIGHT (503, Retry-After)")
        state_metric = metric if shared_state else (lambda *_, **__: _OFF)
        self._state_up = state_metric(Gauge, "epd_trio_state_backend_up",
                                "1 while the shared state store (EPD_STATE_URL) is reachable",
                                multiprocess_mode="livemin")
        self._state_malformed = state_metric(
            Counter, "epd_trio_state_malformed_entries",
            "Entries of the shared state store skipped because they could not be read")
        self._local_limits = state_metric(
            Counter, "epd_trio_state_local_limits",
            "Tenant rate-limit decisions taken on this replica's share of the limit (limit / "
            "live replicas) because the shared state store did not answer")
        self._cursor_fallbacks = state_metric(
            Counter, "epd_trio_global_cursor_fallbacks",
            "Routing decisions that used the replica's own cursor instead of the global one",
            ["stage"])
        tenant_metric = metric if tenants else (lambda *_, **__: _OFF)
        self._tenant_children: dict[tuple[int, str, int | None], Any] = {}
        self._tenant_depth = tenant_metric(
            Gauge, "epd_trio_tenant_queue_depth",
            "Requests waiting for an admission place, per tenant and band", ["tenant", "priority"],
            multiprocess_mode="livesum")
        self._tenant_wait = tenant_metric(
            Histogram, "epd_trio_tenant_wait_seconds",
            "Seconds an admitted request waited for its place, per tenant and band",
            ["tenant", "priority"], **buckets)
        self._tenant_admitted = tenant_metric(
            Counter, "epd_trio_tenant_admitted", "Requests admitted, per tenant and band",
            ["tenant", "priority"])
        self._tenant_headroom = tenant_metric(
            Counter, "epd_trio_tenant_headroom_admitted",
            "Requests started above EPD_MAX_INFLIGHT, in EPD_PRIORITY_HEADROOM, per tenant and "
            "band", ["tenant", "priority"])
        self._tenant_rejected = tenant_metric(
            Counter, "epd_trio_tenant_rejected",
            "Requests refused by admission, per tenant, band and reason (the limit's name, or "
            "deadline: no place within EPD_ADMISSION_TIMEOUT)", ["tenant", "priority", "reason"])
        self._tenant_tokens = tenant_metric(
            Counter, "epd_trio_tenant_tokens_settled",
            "Tokens a tenant's requests used, as settled, per tenant and band (tenants with "
            "tokens_per_minute)", ["tenant", "priority"])
        kv_metric = metric if kv_index else (lambda *_, **__: _OFF)
        self._render = kv_metric(
            Histogram, "epd_trio_kv_render_seconds",
            "Render calls (a request's token ids from vLLM), by outcome (ok, error, timeout)",
            ["outcome"], buckets=FAST_BUCKETS)
        self._lookup = kv_metric(
            Histogram, "epd_trio_kv_lookup_seconds",
            "The proxy's own cost of one KV index lookup: block keys and the prefix match",
            buckets=DECISION_BUCKETS)
        self._kv_prompt = kv_metric(
            Counter, "epd_trio_kv_prompt_tokens",
            "Prompt tokens of the decisions made on the KV index, by stage", ["stage"])
        self._kv_cached = kv_metric(
            Counter, "epd_trio_kv_predicted_cached_tokens",
            "Of those, the tokens the chosen slot held in full blocks, by stage", ["stage"])
        self._kv_decisions = kv_metric(
            Counter, "epd_trio_kv_decisions",
            "Decisions made on the KV index, by stage and the chosen slot's trust state",
            ["stage", "trust"])
        self._bypassed = kv_metric(
            Counter, "epd_trio_prefill_bypassed",
            "Requests sent to decode alone: it held all but EPD_PD_UNCACHED_TOKEN_THRESHOLD "
            "of the prompt")
        self._kv_blocks = kv_metric(
            Gauge, "epd_trio_kv_index_blocks", "Blocks the KV index holds for the slot",
            ["upstream", "rank"], multiprocess_mode="livemax")
        self._kv_trust = kv_metric(
            Gauge, "epd_trio_kv_slot_trust",
            "1 for the slot's trust state (exact, degraded, fallback), 0 for the others",
            ["upstream", "rank", "state"], multiprocess_mode="livemax")
        self._kv_counts = {name: kv_metric(
            Gauge, f"epd_trio_kv_{name}", doc, ["upstream", "rank"], multiprocess_mode="livemax")
            for name, doc in (("events", "KV cache events applied to the slot's index"),
                              ("gaps", "Sequence gaps seen in the slot's events"),
                              ("replays", "Replays asked of the slot's replay socket"))}
        self._kv_slots: set[tuple[str, str]] = set()
        # Children cached by label values (see "Cost" above).
        self._per_instance: dict[tuple[str, str], _InstanceMetrics] = {}
        #: The instances in the roster now (``set_members``).
        self._members: set[tuple[str, str]] = set()
        self._per_request: dict[tuple[str, str, str], Any] = {}
        self._per_reply: dict[tuple[str, bool, str], tuple[Any, Any]] = {}
        self._per_stage = {stage: (self._stage.labels(stage), self._retries.labels(stage),
                                   self._cancels.labels(stage)) for stage in STAGES}
        self.set_members(instances)

    # -- children ------------------------------------------------------------------------------
    def instance(self, stage: str, url: str) -> _InstanceMetrics:
        """The children of one (stage, instance); the metric labels are ``role`` (it predates
        the stage/role distinction, and dashboards use it) and ``upstream`` (the instance's URL:
        not ``instance``, which Prometheus sets to the scrape target and would rename ours to
        ``exported_instance``)."""
        found = self._per_instance.get((stage, url))
        if found is None:
            found = self._per_instance[stage, url] = _InstanceMetrics(
                self._upstream_requests.labels(stage, url), self._upstream_errors.labels(stage, url),
                self._in_flight.labels(stage, url))
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
        current = {(state.stage, state.url): state for state in states}
        for key, state in current.items():
            if key not in self._members:
                self._members.add(key)
                self.instance(*key)
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

    def rank(self, counts: _InstanceMetrics, stage: str, url: str, rank: int) -> Any:
        """The DP-rank counter of an instance's ``rank``."""
        child = counts.ranks.get(rank)
        if child is None:
            child = counts.ranks[rank] = self._ranks.labels(stage, url, str(rank))
        return child

    def stage_seconds(self, stage: str) -> Any:
        """The latency histogram of successful calls of ``stage``."""
        return self._per_stage[stage][0]

    def retried(self, stage: str) -> None:
        self._per_stage[stage][1].inc()

    def client_cancelled(self, stage: str) -> None:
        self._per_stage[stage][2].inc()

    def rendered(self, outcome: str, seconds: float) -> None:
        self._render.labels(outcome).observe(seconds)

    def looked_up(self, seconds: float) -> None:
        self._lookup.observe(seconds)

    def kv_decision(self, stage: str, trust: str, prompt_tokens: int, cached_tokens: int) -> None:
        self._kv_decisions.labels(stage, trust).inc()
        self._kv_prompt.labels(stage).inc(prompt_tokens)
        self._kv_cached.labels(stage).inc(cached_tokens)

    def prefill_bypassed(self) -> None:
        self._bypassed.inc()

    def kv_slots(self, slots: Iterable[tuple[str, str, str, int, dict[str, int]]]) -> None:
        """Every followed slot's index state: ``(url, rank, trust, blocks, counts)``; the series
        of slots no longer followed are removed (not on the hot path: housekeeping)."""
        seen = set()
        for url, rank, trust, blocks, counts in slots:
            seen.add((url, rank))
            self._kv_blocks.labels(url, rank).set(blocks)
            for state in TRUST_STATES:
                self._kv_trust.labels(url, rank, state).set(1 if state == trust else 0)
            for name, gauge in self._kv_counts.items():
                gauge.labels(url, rank).set(counts.get(name, 0))
        for url, rank in self._kv_slots - seen:
            with contextlib.suppress(KeyError):
                self._kv_blocks.remove(url, rank)
                for gauge in self._kv_counts.values():
                    gauge.remove(url, rank)
                for state in TRUST_STATES:
                    self._kv_trust.remove(url, rank, state)
        self._kv_slots = seen

    def kv_missing(self) -> None:
        self._kv_missing.inc()

    def encoded(self, url: str, items: int) -> None:
        self._items.labels(url).inc(items)

    def reply_histograms(self, endpoint: str, stream: bool, model: str = "") -> tuple[Any, Any]:
        """The (time to first byte, duration) children for an endpoint, kind of reply and
        model pool."""
        found = self._per_reply.get((endpoint, stream, model))
        if found is None:
            label = "true" if stream else "false"
            found = self._per_reply[endpoint, stream, model] = (
                self._ttfb.labels(endpoint, label, model),
                self._duration.labels(endpoint, label, model))
        return found

    def request_done(self, endpoint: str, outcome: str, model: str = "") -> None:
        """A client request is over, with ``outcome`` (``_core.trace.OUTCOMES``), in the pool
        of ``model`` ("": none was found: refused first, or a name nobody serves)."""
        key = (endpoint, outcome, model)
        child = self._per_request.get(key)
        if child is None:
            child = self._per_request[key] = self._requests.labels(endpoint, outcome, model)
        child.inc()

    def model_not_found(self) -> None:
        self._unknown_model.inc()

    def alias_picked(self, alias: str, target: str) -> None:
        self._alias_picks.labels(alias, target).inc()

    def pools(self, complete: dict[str, bool]) -> None:
        """Each model pool's completeness now (a roster change, a health change)."""
        for model, whole in complete.items():
            self._pool_complete.labels(model).set(1 if whole else 0)
        for model in self._pools_shown - complete.keys():
            with contextlib.suppress(KeyError):
                self._pool_complete.remove(model)
        self._pools_shown = set(complete)

    def rejected(self, endpoint: str, error: ProxyError) -> None:
        """A request refused before it reached the pipeline (a bad key, a body over the limit,
        the admission cap)."""
        self.request_done(endpoint, outcome_of(error))
        if isinstance(error, AtCapacity):
            self._refused.inc()

    def state_up(self, up: bool) -> None:
        self._state_up.set(1 if up else 0)

    def state_malformed(self) -> None:
        self._state_malformed.inc()

    # -- fair admission (``_admission/fair``: its observer) ------------------------------------
    def tenant_queued(self, tenant: str, priority: int, delta: int) -> None:
        self._tenant_child(self._tenant_depth, tenant, priority).inc(delta)

    def tenant_admitted(self, tenant: str, priority: int, waited: float) -> None:
        self._tenant_child(self._tenant_admitted, tenant, priority).inc()
        self._tenant_child(self._tenant_wait, tenant, priority).observe(waited)

    def tenant_headroom(self, tenant: str, priority: int) -> None:
        self._tenant_child(self._tenant_headroom, tenant, priority).inc()

    def tenant_rejected(self, tenant: str, priority: int, reason: str) -> None:
        self._tenant_rejected.labels(tenant, str(priority), reason).inc()

    def tenant_settled(self, tenant: str, priority: int, tokens: int) -> None:
        self._tenant_child(self._tenant_tokens, tenant, priority).inc(max(0, tokens))

    def _tenant_child(self, family: Any, tenant: str, priority: int | None = None) -> Any:
        """A family's child for (tenant, band), resolved once (``.labels()`` costs µs)."""
        key = (id(family), tenant, priority)
        child = self._tenant_children.get(key)
        if child is None:
            labels = (tenant,) if priority is None else (tenant, str(priority))
            child = self._tenant_children[key] = family.labels(*labels)
        return child

    def state_local_limit(self) -> None:
        self._local_limits.inc()

    def global_cursor_fallback(self, stage: str) -> None:
        self._cursor_fallbacks.labels(stage).inc()

    def health_changed(self, state: InstanceState) -> None:
        """Listener for ``Registry.on_change`` (not on the request path)."""
        self._healthy.labels(state.stage, state.url).set(1 if state.live else 0)
        if not state.live:
            self._evictions.labels(state.stage, state.url).inc()

    # -- reading -------------------------------------------------------------------------------
    def exposition(self) -> bytes | None:
        """The Prometheus text format of every metric (all workers'); None when disabled."""
        return None if self.registry is None else generate_latest(self.registry)
