"""The proxy's owner: the roster, the lifecycle of its pools and prober, and the admin routes.

A ``Proxy`` holds what lives as long as the process serves: the instance roster (``_state/roster_store``:
this process's, or the shared memory of ``epd-trio serve --workers N``), the health registry,
the routing cursors, the upstream connection pools, the prober, and the accounting. A client
request's path through the stages is the ``Pipeline``'s (``_pipeline.py``), which the proxy
builds once and hands those pieces to; the admin and read-only routes (instances, health,
models, profiling) are served here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ._core.config import Settings
from ._core.counters import CursorCounters
from ._core.discovery import Discovered, is_dns_url
from ._core.errors import BadRequest, NoInstance, UpstreamError
from ._core.health import Registry
from ._core.moriio import MoriioRegistration
from ._core.names import ROLES, STAGES, RequestKind
from ._core.policies import Balance, StagePolicy
from ._core.roster import (
    Roster,
    expired,
    forget,
    layout_name,
    parse_instance_url,
    parse_name_registration,
    parse_registration,
    register,
    register_moriio,
    register_name,
    replace_source,
    silent_moriio,
    static_roster,
    unregister,
    unregister_name,
)
from ._core.routing import Instance
from ._discovery.start import discovery_sources
from ._membership.moriio_listener import RegistrationListener
from ._observe.accounting import Accounting
from ._observe.metrics import ProxyMetrics
from ._observe.tracing import NO_TRACE_CONTEXT, TraceHeaders, Tracing
from ._pipeline import Pipeline, Reply, Routes
from ._replicas.identity import default_replica_id
from ._replicas.roster import ReplicatedRoster
from ._state.cursors import EncoderCursor, SlotCursor
from ._state.loads import DECODE_TOKENS, Loads, LocalLoadTable
from ._state.roster_store import RosterStore, SharedRoutingState, routing_state
from ._upstream.legs import get, make_client, upstream_auth_headers
from ._upstream.load_scraper import run_load_scraper
from ._upstream.pool import UpstreamClient, UpstreamPool
from ._upstream.prober import health_check, run_prober
from ._upstream.profile import ProfileReport, run_profile

if TYPE_CHECKING:
    from ._replicas.sync import StateLink

log = logging.getLogger("epd_trio")


class Proxy:
    """Routing state, health and upstream calls for one proxy process.

    ``start(nursery)`` opens the upstream pools and starts the health prober in ``nursery``;
    ``aclose()`` stops the prober, then closes the pools. Everything per request happens in
    ``handle``.

    The instances come from a roster (``_roster.py``): the configured ones, plus those that
    register themselves through ``register``. The roster lives in a ``RosterStore`` (this
    process's, or the shared memory of ``epd-trio serve --workers N``); every new version is
    applied here by ``_apply``: health states, cursors and upstream pools follow it. The pools
    of an instance that left keep serving the requests already routed there; the prober's
    housekeeping closes them once idle (``reap_clients``), ``aclose`` closes all.
    """

    def __init__(
        self, settings: Settings, shared: SharedRoutingState | None = None, *,
        moriio_listener: bool = True, discovery: bool = True,
        clock: Callable[[], float] = time.monotonic, tracing: Tracing | None = None,
    ) -> None:
        """``moriio_listener``: with ``EPD_KV_CONNECTOR=moriio``, whether this process binds the
        registration socket (one worker of ``epd-trio serve --workers N`` does; the shared roster
        carries the registrations to the others). ``clock`` stamps MoRIIO registrations and
        judges their silence (tests pass trio's virtual clock). ``discovery``: whether this
        process runs the DNS and Kubernetes discovery loops (one worker of ``epd-trio serve
        --workers N`` does, like the MoRIIO listener; the shared roster carries what it finds)."""
        self.settings = settings
        self._clock = clock
        #: The ``host:port`` the MoRIIO registration socket is bound to, once it is.
        self.moriio_endpoint: str | None = None
        #: The ZMQ registration listener (``EPD_KV_CONNECTOR=moriio`` in the process that binds).
        self.moriio_listener: RegistrationListener | None = None
        if settings.kv_connector == "moriio" and moriio_listener:
            self.moriio_listener = RegistrationListener(
                settings.moriio_registration, register=self.register_moriio,
                expire=self.expire_moriio, ttl=settings.moriio_ttl, clock=clock)
        replicated = settings.state_url is not None
        if replicated:
            if shared is not None:
                raise ValueError("a shared state store replaces the workers' shared memory")
            counters, load_table = CursorCounters.local(), LocalLoadTable()
            self._replicated = ReplicatedRoster(counters, moriio_clock=clock)
            self._store: RosterStore = self._replicated
        else:
            counters, self._store, load_table = routing_state(shared)
        self.registry = Registry(threshold=settings.health_threshold)
        #: Every count the proxy exports (``/metrics``).
        self.metrics = ProxyMetrics(enabled=settings.metrics, shared_state=replicated)
        self.registry.on_change.append(_log_health_change)
        self.registry.on_change.append(self.metrics.health_changed)
        #: In-flight requests per stage and slot: what the load-aware policies read.
        self.loads = Loads(load_table)
        #: The link to the shared state store (``EPD_STATE_URL``), None without one.
        self.state: StateLink | None = None
        if replicated:
            # Imported only here: without a state store, no Redis client is even loaded.
            from ._replicas.sync import StateLink, live_member
            self.state = StateLink(settings, self._replicated, self.loads, self.metrics,
                                   replica_id=settings.replica_id or default_replica_id(),
                                   live=live_member(self.registry))
        take = self.state.take if self.state is not None and settings.global_cursor else None
        cursor_of = {stage: None if take is None else partial(take, stage) for stage in STAGES}
        self.encoders = EncoderCursor((), counter=counters.encode,
                                      policy=stage_policy(settings, "encode"),
                                      loads=partial(self.loads.read, "encode"),
                                      global_cursor=cursor_of["encode"])
        self.prefills = SlotCursor((), counter=counters.prefill,
                                   policy=stage_policy(settings, "prefill"),
                                   loads=partial(self.loads.read, "prefill"),
                                   global_cursor=cursor_of["prefill"])
        self.decodes = SlotCursor((), counter=counters.decode,
                                  policy=stage_policy(settings, "decode"),
                                  loads=partial(self.loads.read, "decode"),
                                  sizes=(partial(self.loads.read, DECODE_TOKENS)
                                         if settings.size_tiebreak else None),
                                  global_cursor=cursor_of["decode"])
        self.pipeline = Pipeline(
            settings, pools=self.client,
            routes=Routes(self.encoders, self.prefills, self.decodes, self.loads),
            registry=self.registry,
            accounting=Accounting(self.registry, self.metrics, request_log=settings.request_log,
                                  tracing=tracing),
            moriio_peer=lambda inst: self.roster.moriio_peer(inst.url),
            transfer_mode=lambda: self.roster.transfer_mode,
            ec_zmq_addrs=self._ec_zmq_addrs)
        self._upstream: UpstreamClient | None = None
        self._probe_client: UpstreamClient | None = None
        self._prober: trio.CancelScope | None = None
        self._listener_scope: trio.CancelScope | None = None
        self._roster_changed = trio.Event()
        self.roster = Roster()
        #: The discovery sources this process runs (``_discovery``), started with the prober.
        self.discovery = discovery_sources(
            settings, self.discovered, registered=self._registered_names,
            apply_registered=partial(self.discovered, registered=True)) if discovery else []
        initial = static_roster(settings.listed("encode"), settings.listed("prefill"),
                                settings.listed("decode"))
        self._apply(initial)
        self._store.attach(initial, self._apply)

    # -- the roster ------------------------------------------------------------------------------
    def _apply(self, roster: Roster) -> None:
        """Follow a new roster version: health states, cursors, pools (synchronous: it runs
        inside a cursor's counter step when another worker changed the roster)."""
        self.roster = roster
        self.registry.set_members({stage: roster.of(stage) for stage in STAGES})
        self.metrics.set_members(self.registry.states())
        self.encoders.update(roster.of("encode"), roster.epochs["encode"])
        self.prefills.update(roster.of("prefill"), roster.epochs["prefill"])
        self.decodes.update(roster.of("decode"), roster.epochs["decode"])
        for client in (self._upstream, self._probe_client):
            if client is not None:
                client.follow(m.instance for m in roster.members)
        self._roster_changed.set()
        self._roster_changed = trio.Event()

    async def wait_roster(self, predicate: Callable[[Roster], bool]) -> None:
        """Wait until ``predicate(roster)`` holds (re-checked at each new roster version)."""
        while True:
            self._store.poll()
            if predicate(self.roster):
                return
            await self._roster_changed.wait()

    def register(self, raw_body: bytes) -> bool:
        """``POST /instances``: add or refresh an instance; True when it was new.

        Raises ``BadRequest`` (400) for a bad body or a prefill_decode / prefill+decode mix,
        ``Conflict`` (409) for a known URL changing its role.
        """
        name = parse_name_registration(raw_body)
        if name is not None:
            role, dns_name = name
            if self.settings.state_url is not None:
                # Discovered instances are each replica's own, not shared through the store:
                # a name registered with one replica would serve that replica alone.
                raise BadRequest("with a shared roster (EPD_STATE_URL) a DNS name is configured "
                                 "on every replica (EPD_DECODE_URLS=dns+http://...), not "
                                 "registered with one")
            return self._store.update(
                lambda roster, counters: register_name(roster, role, dns_name.spec))
        member = parse_registration(raw_body, time.monotonic())
        created = self._store.update(lambda roster, counters: register(roster, member, counters))
        if created:
            log.warning("%s instance %s registered (dp_size %d)", member.role, member.url,
                        member.instance.dp_size)
        return created

    def discovered(
        self, source: str, role: str, instances: Sequence[Discovered], *, registered: bool = False
    ) -> tuple[list[str], list[str]]:
        """A discovery source's whole current answer: it replaces that source's members;
        ``(URLs that joined, URLs that left)``. Idempotent (no new version when nothing changed).
        ``registered``: a registered DNS name's answer, dropped once the name is unregistered."""

        def change(roster: Roster, counters: Any) -> tuple[Roster, tuple[list[str], list[str]]]:
            if registered and (role, source) not in roster.names:
                return roster, ([], [])
            return replace_source(roster, source, role, instances, counters)

        # Most rounds change nothing: check on this process's copy first, so that they never
        # take the shared lock the routing counters use (a change missed because another
        # worker changed the roster meanwhile is made at the next round).
        self._store.poll()
        if change(self.roster, dict.fromkeys(STAGES, 0))[0] is self.roster:
            return [], []
        return self._store.update(change)

    def _registered_names(self) -> tuple[tuple[str, str], ...]:
        self._store.poll()
        return self.roster.names

    def _ec_zmq_addrs(self, instance: Instance) -> tuple[str, ...]:
        member = self.roster.find(instance.url)
        return () if member is None else member.ec_zmq_addrs

    def register_moriio(self, registration: MoriioRegistration, now: float) -> bool:
        """A MoRIIO heartbeat: add or refresh the instance; True when it was new. Raises
        ``RegistrationRefused`` (the other transfer mode, a role change)."""
        created = self._store.update(
            lambda roster, counters: register_moriio(roster, registration, counters, now))
        if created:
            log.warning("MoRIIO %s instance %s registered (dp_size %d, tp_size %d, %s, zmq %s)",
                        registration.role, registration.instance.url,
                        registration.peer.dp_size, registration.peer.tp_size,
                        registration.transfer_mode, registration.peer.zmq_address)
        return created

    def expire_moriio(self, now: float) -> list[str]:
        """Forget the MoRIIO instances silent for ``moriio_ttl`` (they beat every 3 s).

        With a shared state store their entries expire there instead (``_replicas/sync``): a
        replica that cannot reach the store keeps its last view."""
        if self.state is not None:
            return []
        ttl = self.settings.moriio_ttl

        def change(roster: Roster, counters: Any) -> tuple[Roster, list[str]]:
            urls = silent_moriio(roster, now, ttl)
            return forget(roster, urls, counters), urls

        urls = self._store.update(change)
        for url in urls:
            log.warning("MoRIIO instance %s left the rotation: silent for %g s", url, ttl)
        return urls

    def unregister(self, url: object) -> bool:
        """``DELETE /instances``: remove the instance at ``url``; True when it was there."""
        if isinstance(url, str) and url.startswith(("dns ", "dnssrv ")):
            url = url.replace(" ", "+", 1)  # an unencoded '+' in the query became a space
        if isinstance(url, str) and is_dns_url(url):
            spec = url.strip()
            removed = self._store.update(
                lambda roster, counters: unregister_name(roster, spec, counters))
            if removed:
                log.warning("DNS name %s unregistered", spec)
            return removed
        target = parse_instance_url(url).url
        removed = self._store.update(lambda roster, counters: unregister(roster, target, counters))
        if removed:
            log.warning("instance %s unregistered", target)
        return removed

    def expire(self, now: float | None = None) -> list[str]:
        """Forget the registered instances that have been out of rotation and silent for
        ``instance_ttl`` (judged on this worker's health view and the shared roster).

        With a shared state store, entries expire there instead (``_replicas/sync``)."""
        evicted = self.registry.evicted()
        if not evicted or self.state is not None:
            return []
        now = time.monotonic() if now is None else now
        ttl = self.settings.instance_ttl

        def change(roster: Roster, counters: Any) -> tuple[Roster, list[str]]:
            urls = expired(roster, evicted, now, ttl)
            return forget(roster, urls, counters), urls

        urls = self._store.update(change)
        for url in urls:
            log.warning("instance %s forgotten: out of rotation and not registered for %g s",
                        url, ttl)
        return urls

    def instances(self) -> dict[str, Any]:
        """``GET /instances``: every instance by role, where it comes from, and its state."""
        roster = self._store.current()
        now, moriio_now = time.monotonic(), self._clock()
        listing: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
        for member in roster.members:
            entry = self.registry.state_for(member.stage, member.instance).report()
            entry.update(source="static" if member.static else "registered",
                         ec_zmq_addrs=list(member.ec_zmq_addrs))
            if member.source is not None:
                entry.update(source="discovered", discovered_by=member.source)
            if not member.static and member.source is None:
                entry["registered_seconds_ago"] = round(now - member.registered_at, 3)
            if member.moriio is not None:
                entry.update(source="moriio", zmq_address=member.moriio.zmq_address,
                             tp_size=member.moriio.tp_size, transfer_mode=roster.transfer_mode,
                             registered_seconds_ago=round(moriio_now - member.registered_at, 3))
            listing[member.role].append(entry)
        # Health is each worker's own view (each probes on its own): say whose view this is.
        names = [{"role": role, "url": name.spec, "source": "static"}
                 for role, name in self.settings.dns_names()]
        names += [{"role": role, "url": spec, "source": "registered"} for role, spec in roster.names]
        report = {"layout": layout_name(roster), "version": roster.version,
                  "worker_pid": os.getpid(), "instances": listing, "dns_names": names}
        if self.state is not None:
            report.update(replica=self.state.replica_id, state=self.state.describe())
        return report

    def client(self, instance: Instance) -> UpstreamPool:
        """The connection pool for ``instance`` (one per instance, see ``make_client``)."""
        if self._upstream is None:
            raise RuntimeError("Proxy.client used outside start()/aclose()")
        return self._upstream.pool(instance)

    async def reap_clients(self) -> int:
        """Close the pools of instances that left, once nothing is in flight on them; returns
        how many request pools were closed."""
        closed = 0
        if self._probe_client is not None:
            await self._probe_client.reap()
        if self._upstream is not None:
            closed = await self._upstream.reap()
        return closed

    async def start(self, nursery: trio.Nursery | None = None) -> None:
        """Open the upstream pools; with a ``nursery``, also start the health prober in it."""
        self._upstream = make_client(self.settings)
        self._upstream.follow(m.instance for m in self.roster.members)
        if nursery is not None:
            # Probes get their own small pools: a pool full of long streams must not delay
            # them into timeouts that would evict healthy instances.
            self._probe_client = UpstreamClient(
                max_connections=4, connect_timeout=self.settings.health_timeout,
                queue_timeout=self.settings.health_timeout,
                keepalive_expiry=self.settings.upstream_keepalive,
                headers=upstream_auth_headers(self.settings))
            self._probe_client.follow(m.instance for m in self.roster.members)
            if self.moriio_listener is not None:
                # Bound before the app serves; a port in use fails start-up with an OSError.
                self._listener_scope = trio.CancelScope()
                self.moriio_endpoint = await nursery.start(self._run_listener,
                                                           self._listener_scope)
            self._prober = await nursery.start(self._run_background, self._probe_client)

    async def _run_listener(
        self, scope: trio.CancelScope, task_status: trio.TaskStatus[str]
    ) -> None:
        """The MoRIIO registration listener, until ``aclose`` cancels ``scope``."""
        assert self.moriio_listener is not None
        with scope:
            await self.moriio_listener.run(task_status=task_status)

    async def _run_background(
        self, client: UpstreamClient, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        """The proxy's background work, until cancelled: the health prober, and housekeeping
        on the keep-alive clock."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                for source in self.discovery:  # each finds its instances once before serving
                    await nursery.start(source.run)
                task_status.started(scope)
                nursery.start_soon(partial(
                    run_prober, health_check(client, self.settings.health_timeout),
                    self.registry, interval=self.settings.health_interval,
                    before_round=self._store.poll))
                nursery.start_soon(self._housekeeping)
                if self.state is not None:
                    await nursery.start(self.state.run)
                if self.settings.load_scrape_interval > 0:
                    nursery.start_soon(partial(
                        run_load_scraper, self._scrape_targets, client.pool, self.loads,
                        interval=self.settings.load_scrape_interval,
                        deadline=self.settings.health_timeout))

    def _scrape_targets(self) -> list[tuple[str, Instance]]:
        """Every instance the load-aware policies may read a scrape of, by stage."""
        self._store.poll()
        return [(m.stage, m.instance) for m in self.roster.members]

    async def _housekeeping(self) -> None:
        """Twice per upstream keep-alive: close the idle connections past it and the pools
        nobody uses any more, and forget the long-gone registered instances.

        Why its own clock and not the prober's: with a long ``EPD_HEALTH_INTERVAL`` a dead
        instance's idle connections stayed open for the whole interval (the churn soak: 88 fds
        10 s after the load, at 600 s), far past the keep-alive they exist within."""
        while True:
            await trio.sleep(self.settings.upstream_keepalive / 2)
            self.expire()
            await self.reap_clients()

    async def aclose(self) -> None:
        if self._listener_scope is not None:
            self._listener_scope.cancel()
            self._listener_scope = None
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None
        with trio.CancelScope(shield=True):
            for client in (self._upstream, self._probe_client):
                if client is not None:
                    await client.aclose()
        self._upstream = self._probe_client = None

    # -- client requests -------------------------------------------------------------------------
    async def handle(
        self, kind: RequestKind, raw_body: bytes, *, request_id: str, resources: AsyncExitStack,
        trace_context: TraceHeaders = NO_TRACE_CONTEXT,
    ) -> Reply:
        """One client request: ``Pipeline.run``, on the roster as it is now."""
        self._store.poll()  # one word read: did another worker change the roster?
        return await self.pipeline.run(kind, raw_body, request_id=request_id,
                                       resources=resources, trace_context=trace_context)

    # -- other endpoints -----------------------------------------------------------------------
    async def models(self) -> Reply:
        """``GET /v1/models`` from the first live decode-side instance that answers."""
        self._store.poll()
        usable = self.registry.usable("decode")
        candidates = sorted(self.roster.of("decode"), key=lambda inst: not usable(inst))
        if not candidates:
            raise NoInstance("no decode instance is configured or registered yet")
        last_error: UpstreamError | None = None
        for instance in candidates:
            try:
                response = await get(self.client(instance), "decode", instance, "/v1/models",
                                     self.settings.health_timeout + self.settings.connect_timeout)
            except UpstreamError as error:
                last_error = error
                continue
            return Reply(response.status, {"content-type": response.content_type},
                         body=response.content)
        assert last_error is not None
        raise last_error

    def health(self) -> dict[str, Any]:
        """``GET /health``, the liveness report: overall ``status``, readiness, and each
        instance's state (the HTTP status is always 200 while the process serves)."""
        self._store.poll()
        report = {"status": self.registry.status(), "layout": layout_name(self.roster),
                  "ready": self.registry.ready(), "roles": self.registry.report()}
        if self.state is not None:
            report["state"] = self.state.describe()
        return report

    def ready(self) -> bool:
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, str | None]:
        """Whether the proxy can serve every role now, and if not, why (``/ready``)."""
        self._store.poll()
        if self.state is not None and not self._replicated.loaded:
            return False, (f"the shared roster is not loaded yet ({self.state.problem})"
                           if self.state.problem else "the shared roster is not loaded yet")
        if not self.registry.ready():
            return False, "a role has no instance in rotation"
        return True, None

    async def profile(self, action: str, raw_body: bytes) -> ProfileReport:
        """``POST /start_profile`` / ``/stop_profile`` on every instance of every role."""
        self._store.poll()
        targets = [(m.role, m.instance) for m in self.roster.members]
        return await run_profile(action, raw_body, targets, self.client,
                                 deadline=self.settings.profile_timeout)


def stage_policy(settings: Settings, stage: str) -> StagePolicy:
    """The policy ``settings`` give ``stage`` (``EPD_<STAGE>_POLICY`` and the cache knobs);
    with a shared state store, ``cache_aware`` places what it has not seen alike on every
    replica (``StagePolicy.placement``)."""
    return StagePolicy(getattr(settings, f"{stage}_policy"),
                       Balance(settings.cache_balance_abs, settings.cache_balance_rel),
                       cache_threshold=settings.cache_threshold, cache_size=settings.cache_size,
                       placement=settings.state_url is not None)


def _log_health_change(state: Any) -> None:
    if state.live:
        log.warning("%s instance %s is back in rotation", state.stage, state.url)
    else:
        log.warning("%s instance %s left the rotation after %d consecutive failure(s)",
                    state.stage, state.url, state.consecutive_failures)
