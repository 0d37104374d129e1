"""The proxy's owner: the request path's pieces, their lifecycle, and the admin routes.

A ``Proxy`` holds what lives as long as the process serves and a request is routed over: the
health registry, the routing cursors, the upstream connection pools, the prober, and the
accounting. Who is in the roster is not its business but ``Membership``'s
(``_membership/roster_owner``: registrations, discovery, MoRIIO, expiry, the roster store); the
proxy *pulls* each new roster version from it at known points (``sync``: the top of a client
request and of every admin or read-only route, each housekeeping round, and a cursor whose
counter step belongs to a newer version) and follows it there, in one place. A client request's
path through the stages is the ``Pipeline``'s (``_pipeline.py``), which the proxy builds once
and hands those pieces to; the admin and read-only routes (instances, health, models,
profiling) are served here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ._admission.fair import Ticket
from ._core.config import Settings
from ._core.counters import CursorCounters
from ._core.errors import NoInstance, UpstreamStatusError, UpstreamTransportError
from ._core.health import Registry
from ._core.names import MODEL_ENDPOINTS, ROLES, STAGES, RequestKind
from ._core.roster import (
    Card,
    Member,
    Roster,
    layout_name,
    parse_name_registration,
    parse_registration,
)
from ._core.routing import Instance
from ._kv_routing import KvRouting
from ._membership.roster_owner import Membership
from ._model_api import ApiRun
from ._model_pools import ModelPools, ModelRoute
from ._models.learner import ModelLearner
from ._models.loading import AdapterLoader
from ._models.pools import Pool, reloaded_adapters
from ._models.tables import Tables, parse_tables
from ._observe.accounting import Accounting
from ._observe.metrics import ProxyMetrics
from ._observe.tracing import NO_TRACE_CONTEXT, TraceHeaders, Tracing
from ._pipeline import Pipeline, Reply
from ._replicas.identity import default_replica_id
from ._replicas.roster import ReplicatedRoster
from ._state.cursors import Follow
from ._state.loads import Loads, LocalLoadTable
from ._state.roster_store import RosterStore, SharedRoutingState, routing_state
from ._state.tasks import Supervisor, named
from ._upstream.legs import get, make_client, post_json, upstream_auth_headers
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

    The instances come from ``membership`` (``_membership/roster_owner``): the configured ones,
    plus those that register, are discovered or send MoRIIO heartbeats. ``sync`` pulls a new
    roster version from it and follows it everywhere at once: health states, metrics, cursors
    and upstream pools. The pools of an instance that left keep serving the requests already
    routed there; the housekeeping closes them once idle (``reap_clients``), ``aclose`` closes
    all.
    """

    def __init__(
        self, settings: Settings, shared: SharedRoutingState | None = None, *,
        moriio_listener: bool = True, discovery: bool = True,
        clock: Callable[[], float] = time.monotonic, tracing: Tracing | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """``moriio_listener``, ``discovery`` and ``clock``: see ``Membership`` (whether this
        process binds the MoRIIO socket and runs the discovery loops; the MoRIIO clock).
        ``on_failure``: how a per-process task's death stops the process (``Supervisor``)."""
        self.settings = settings
        #: The model and alias tables (``ConfigError`` for a bad one).
        self.tables: Tables = parse_tables(settings)
        #: The owner of the per-process tasks, and the verdict when one of them dies.
        self.tasks = Supervisor(on_failure)
        self._clock = clock
        replicated = settings.state_url is not None
        if replicated:
            if shared is not None:
                raise ValueError("a shared state store replaces the workers' shared memory")
            # Each replica's pools start their rotation at a random slot (the store's offset,
            # ``with_pool_epochs``): replicas restarted together do not move in lockstep.
            counters, load_table = CursorCounters.local(), LocalLoadTable()
            self._replicated = ReplicatedRoster(counters, moriio_clock=clock)
            store: RosterStore = self._replicated
        else:
            counters, store, load_table = routing_state(shared)
        self.registry = Registry(threshold=settings.health_threshold)
        #: Every count the proxy exports (``/metrics``).
        reads_index = reads_kv_index(settings, self.tables)
        self.metrics = ProxyMetrics(enabled=settings.metrics, shared_state=replicated,
                                    kv_index=reads_index,
                                    tenants=bool(settings.tenants or settings.tenant_header))
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
        # After each counter step a cursor asks which roster version the value belongs to (what
        # the store recorded in that step) and, when its list is older, pulls that one.
        follow = Follow(version=lambda: store.seen.version, pull=partial(self.sync, look=False))
        #: The KV index and the render call, when a policy or the prefill bypass reads them.
        self.kv: KvRouting | None = None
        if reads_index:
            self.kv = KvRouting(settings, pools=self.client, metrics=self.metrics,
                                render_targets=self._render_targets)
        #: Each model's pool and its routing state (cursors, policies, cap).
        self.models = ModelPools(settings, self.tables, counters.pools, loads=self.loads,
                                 registry=self.registry, follow=follow, take=take,
                                 kv=self.kv is not None)
        self.models.on_pick = self.metrics.alias_picked
        self.registry.on_change.append(lambda state: self._publish_pools())
        #: Configured adapters loaded on demand (``EPD_LORA_LOAD``).
        self.adapter_loader = (AdapterLoader(self._post_load, self._adapter_loaded,
                                             retry_after=settings.health_interval)
                               if settings.lora_load else None)
        self.pipeline = Pipeline(
            settings, pools=self.client, kv=self.kv, models=self.models, loads=self.loads,
            adapter_loader=self.adapter_loader, registry=self.registry,
            accounting=Accounting(self.registry, self.metrics, request_log=settings.request_log,
                                  tracing=tracing),
            moriio_peer=lambda inst: self.roster.moriio_peer(inst.url),
            transfer_mode=lambda: self.roster.transfer_mode,
            ec_zmq_addrs=self._ec_zmq_addrs)
        self._upstream: UpstreamClient | None = None
        self._probe_client: UpstreamClient | None = None
        self._prober: trio.CancelScope | None = None
        #: What each instance served in the roster last followed (adapter reloads are found
        #: against it).
        self._served_seen: Mapping[str, Any] = {}
        #: Who is in the roster (registrations, discovery, MoRIIO, expiry): pulled by ``sync``.
        self.membership = Membership(settings, store, moriio_listener=moriio_listener,
                                     discovery=discovery, clock=clock,
                                     pool_tables=self.tables.pools, pool_counters=counters.pools)
        #: What each instance serves: asked every interval by the process that discovers (for
        #: those sharing its roster), and by any process that takes a registration, at once.
        self.learner = ModelLearner(
            ask=self._ask_models, roster=lambda: self.membership.current(),
            apply=self._learned, changed=self.membership.wait_change,
            interval=settings.models_interval, timeout=settings.health_timeout,
            tables=self.tables.pools)
        self._learns = discovery
        self.sync()

    # -- the roster ------------------------------------------------------------------------------
    @property
    def roster(self) -> Roster:
        """The roster the request path follows (the one last pulled)."""
        return self.membership.roster

    def sync(self, *, look: bool = True) -> None:
        """Pull a new roster version from ``membership`` and follow it: health states, metrics,
        cursors, pools. With no new version it costs one word read (``look=False``, a cursor
        catching up after its counter step: not even that).

        The one place the request path learns of a change, called at known points only (see
        the module); synchronous, so a request never sees the pieces disagree."""
        roster = self.membership.pull(look=look)
        if roster is None:
            return
        self.registry.set_members({stage: roster.of(stage) for stage in STAGES})
        self.metrics.set_members(self.registry.states())
        self.models.follow(roster)
        self._publish_pools()
        if self.kv is not None:  # an adapter reloaded under its name: its blocks are stale
            for url, adapter in reloaded_adapters(self._served_seen, roster.served):
                self.kv.drop_adapter(url, adapter)
        self._served_seen = roster.served
        for client in (self._upstream, self._probe_client):
            if client is not None:
                client.follow(m.instance for m in roster.members)
        if self.kv is not None:
            self.kv.follow(roster)

    def _publish_pools(self) -> None:
        """Each model's completeness, for ``epd_trio_model_pool_complete`` (and its alert)."""
        models = self.models
        self.metrics.pools({name: models.complete(route.pool)
                            for name, route in models.by_name.items()})

    def route(self, model: str | None = None) -> ModelRoute:
        """The routing state of ``model``'s pool (by default the one model served): for tests,
        the bench and embedders that look at a cursor."""
        return self.models.resolve(model)[0]

    def _render_targets(self, pool: Pool) -> list[Instance]:
        """Where a request is rendered into token ids: ``EPD_RENDER_URLS``, else the live
        instances of its model's pool at the stages the index routes (prefill first: it
        renders the prompt anyway), which have its tokenizer."""
        listed = self.settings.listed("render")
        if listed:
            return list(listed)
        for stage in ("prefill", "decode"):
            usable = self.registry.usable(stage)
            found = [inst for inst in pool.of(stage) if usable(inst)]
            if found:
                return found
        return []

    async def _ask_models(self, member: Member) -> tuple[int, bytes]:
        """One instance's ``GET /v1/models`` (the learner's call): its status and body."""
        await trio.lowlevel.checkpoint()  # a round cancelled by ``aclose`` stops here
        client = self._probe_client
        if client is None:
            raise UpstreamTransportError("the proxy is closing", stage=member.stage,
                                         instance=member.url)
        try:
            answer = await get(client.pool(member.instance), member.stage,
                               member.instance, "/v1/models", self.settings.health_timeout)
        except UpstreamStatusError as error:
            return error.upstream_status, error.upstream_body
        return answer.status, answer.content

    async def _post_load(self, stage: str, instance: Instance, body: dict[str, str]) -> object:
        """``POST /v1/load_lora_adapter`` (the adapter loader's one call): a load takes the
        time of reading the weights, bounded like a prefill."""
        return await post_json(self.client(instance), stage=stage, instance=instance,
                               path="/v1/load_lora_adapter", body=body,
                               headers={"content-type": "application/json"},
                               deadline=self.settings.prefill_timeout,
                               detail="loading a LoRA adapter: ")

    def _adapter_loaded(self, url: str, card: Card) -> None:
        """The instance at ``url`` loaded ``card``'s adapter: it serves it now (as its next
        ``/v1/models`` will say), in the roster every worker routes on; followed at once."""
        served = self.membership.current().served.get(url) or ()
        self._learned({url: (*(c for c in served if c.id != card.id), card)})

    def _learned(self, answers: Any) -> None:
        """A learner round's answers, into the roster; followed here at once."""
        self.membership.learned(answers)
        self.sync()

    async def wait_roster(self, predicate: Callable[[Roster], bool]) -> None:
        """Wait until ``predicate(roster)`` holds (pulled and re-checked at each change the
        membership wakes its waiters for)."""
        while True:
            self.sync()
            if predicate(self.roster):
                return
            await self.membership.wait_change()

    def register(self, raw_body: bytes) -> bool:
        """``POST /instances`` (``Membership.register``), followed here at once."""
        created = self.membership.register(raw_body)
        self.sync()
        return created

    async def ask_registered(self, raw_body: bytes) -> None:
        """Ask the instance a registration (``raw_body``, registered already) names what it
        serves, now, unless it has said so: the instance serves its models when the
        registration is answered, not at the learner's next wake-up. An instance that
        registers again after it left is asked again (its answer left with it).

        Only that one: another instance that has not answered (down, hung) is the learner's to
        ask again, and asking it here would hold every registration for up to the probe
        timeout. A DNS name's instances are asked by the learner once they resolve."""
        if self._probe_client is None or parse_name_registration(raw_body) is not None:
            return
        roster = self.membership.current()
        member = roster.find(parse_registration(raw_body, time.monotonic()).url)
        if member is not None and member.url not in roster.served:
            await self.learner.round([member])

    def unregister(self, url: object) -> bool:
        """``DELETE /instances`` (``Membership.unregister``), followed here at once."""
        removed = self.membership.unregister(url)
        self.sync()
        return removed

    def _ec_zmq_addrs(self, instance: Instance) -> tuple[str, ...]:
        member = self.roster.find(instance.url)
        return () if member is None else member.ec_zmq_addrs

    def instances(self) -> dict[str, Any]:
        """``GET /instances``: every instance by role, where it comes from, and its state."""
        self.sync()
        roster = self.membership.current()
        now, moriio_now = time.monotonic(), self._clock()
        listing: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
        for member in roster.members:
            entry = self.registry.state_for(member.stage, member.instance).report()
            entry.update(source="static" if member.static else "registered",
                         ec_zmq_addrs=list(member.ec_zmq_addrs))
            entry.update(served_names(member, roster))
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
        if self.kv is not None:
            # Each worker's own view, like health: every process subscribes on its own.
            report["kv_index"] = [{"url": url, "rank": rank, **entry}
                                  for (url, rank), entry in self.kv.report().items()]
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
            await self.membership.start(nursery)
            self._prober = await nursery.start(self._run_background, self._probe_client)

    async def _run_background(
        self, client: UpstreamClient, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        """The proxy's background work, until cancelled: the health prober, and housekeeping
        on the keep-alive clock; the discovery sources (each finds its instances once before
        serving). Each prober round pulls the roster first, so that instances registered
        through another worker get probed within the interval."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await self.membership.start_discovery(nursery)
                # Every instance asked once before serving, in every worker (the answers are
                # the same: no new version), so no worker serves before it knows the models;
                # then one process asks every interval for those sharing its roster.
                if self._learns:
                    await nursery.start(named("model learner", self.learner.run))
                else:
                    await self.learner.round()
                self.sync()
                task_status.started(scope)
                nursery.start_soon(named("prober", partial(
                    run_prober, health_check(client, self.settings.health_timeout),
                    self.registry, interval=self.settings.health_interval,
                    before_round=self.sync)))
                nursery.start_soon(named("housekeeping", self._housekeeping))
                if self.kv is not None:
                    await nursery.start(named("KV events", self.kv.run))
                if self.state is not None:
                    await nursery.start(named("state link", self.state.run))
                if self.settings.load_scrape_interval > 0:
                    nursery.start_soon(named("load scraper", partial(
                        run_load_scraper, self._scrape_targets, client.pool, self.loads,
                        interval=self.settings.load_scrape_interval,
                        deadline=self.settings.health_timeout)))

    def _scrape_targets(self) -> list[tuple[str, Instance]]:
        """Every instance the load-aware policies may read a scrape of, by stage (each scrape
        round pulls the roster first)."""
        self.sync()
        return [(m.stage, m.instance) for m in self.roster.members]

    async def _housekeeping(self) -> None:
        """Twice per upstream keep-alive: close the idle connections past it and the pools
        nobody uses any more, and forget the long-gone registered instances.

        Why its own clock and not the prober's: with a long ``EPD_HEALTH_INTERVAL`` a dead
        instance's idle connections stayed open for the whole interval (the churn soak: 88 fds
        10 s after the load, at 600 s), far past the keep-alive they exist within."""
        while True:
            await trio.sleep(self.settings.upstream_keepalive / 2)
            self.membership.expire(self.registry.evicted())
            self.sync()  # a housekeeping round pulls: what expired leaves before the reaping
            await self.reap_clients()
            if self.kv is not None:
                self.kv.publish_stats()

    async def aclose(self) -> None:
        self.membership.close()
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None
        with trio.CancelScope(shield=True):
            for client in (self._upstream, self._probe_client):
                if client is not None:
                    await client.aclose()
        self._upstream = self._probe_client = None

    # -- client requests -------------------------------------------------------------------------
    def handle(
        self, kind: RequestKind, raw_body: bytes, *, request_id: str, resources: AsyncExitStack,
        trace_context: TraceHeaders = NO_TRACE_CONTEXT, ticket: Ticket | None = None,
        session: str | None = None,
    ) -> Coroutine[Any, Any, Reply]:
        """One client request: ``Pipeline.run``, on the roster as it is now, to await.

        Not a coroutine of its own: every time the request's innermost wait resumes, each
        coroutine frame around it resumes too, and this one would add nothing but that cost
        (its caller awaits the pipeline's coroutine at once)."""
        self.sync()  # one word read: did the roster change (here, or in another worker)?
        return self.pipeline.run(kind, raw_body, request_id=request_id, resources=resources,
                                 trace_context=trace_context, ticket=ticket, session=session)

    def handle_api(
        self, path: str, raw_body: bytes, *, content_type: str | None, request_id: str,
        resources: AsyncExitStack, trace_context: TraceHeaders = NO_TRACE_CONTEXT,
        ticket: Ticket | None = None, session: str | None = None,
    ) -> Coroutine[Any, Any, Reply]:
        """One request of vLLM's other endpoints (``MODEL_ENDPOINTS``): ``_model_api``, to
        await (no frame of its own, as ``handle``)."""
        self.sync()
        return self.pipeline.run_on(
            ApiRun, path, partial(ApiRun.answer, form=MODEL_ENDPOINTS[path] == "form",
                                  raw_body=raw_body, content_type=content_type,
                                  resources=resources, session=session),
            request_id=request_id, resources=resources, trace_context=trace_context,
            ticket=ticket)

    # -- other endpoints -----------------------------------------------------------------------
    def models_listing(self, allowed: Any = None) -> dict[str, Any]:
        """``GET /v1/models``: each name a client may send that can serve now (the models
        with a complete live pool, with their instances' own cards, and the aliases), from
        what the instances said: no call made. ``allowed``: a tenant's model list. A 503
        while no instance has said what it serves (an empty list would say "none")."""
        self.sync()
        pending = self.models.catalog.pending
        if pending is not None:
            raise NoInstance(pending)
        return self.models.listing(allowed)

    def health(self) -> dict[str, Any]:
        """``GET /health``, the liveness report: overall ``status``, readiness, and each
        instance's state (the HTTP status is always 200 while the process serves)."""
        self.sync()
        failure = self.tasks.failure
        report = {"status": "failed" if failure else self.registry.status(),
                  "layout": layout_name(self.roster),
                  "ready": self.registry.ready() and not failure, "roles": self.roles()}
        if failure:
            report["failure"] = failure
        if self.state is not None:
            report["state"] = self.state.describe()
        return report

    def roles(self) -> dict[str, list[dict[str, Any]]]:
        """Each instance's health by its role, named as ``GET /instances`` names it (a combined
        instance is ``prefill_decode``, though it serves the decode stage)."""
        self.sync()
        listing: dict[str, list[dict[str, Any]]] = {}
        for member in self.roster.members:
            state = self.registry.state_for(member.stage, member.instance)
            listing.setdefault(member.role, []).append(state.report())
        return listing

    def ready(self) -> bool:
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, str | None]:
        """Whether the proxy can serve every role now, and if not, why (``/ready``)."""
        self.sync()
        if self.tasks.failure:
            return False, self.tasks.failure
        if self.state is not None and not self._replicated.loaded:
            return False, (f"the shared roster is not loaded yet ({self.state.problem})"
                           if self.state.problem else "the shared roster is not loaded yet")
        if not self.registry.ready():
            return False, "a role has no instance in rotation"
        return True, None

    async def profile(self, action: str, raw_body: bytes) -> ProfileReport:
        """``POST /start_profile`` / ``/stop_profile`` on every instance of every role."""
        self.sync()
        targets = [(m.role, m.instance) for m in self.roster.members]
        return await run_profile(action, raw_body, targets, self.client,
                                 deadline=self.settings.profile_timeout)


def served_names(member: Member, roster: Roster) -> dict[str, Any]:
    """What ``GET /instances`` says ``member`` serves: ``models`` (its base names, or ``"*"``
    for any name) and where that comes from (``models_from``)."""
    if member.url in roster.served:
        cards = roster.served[member.url]
        if cards is None:
            return {"models": "*", "models_from": "no /v1/models route (404): any name"}
        return {"models": [c.id for c in cards if c.parent is None],
                "adapters": [c.id for c in cards if c.parent is not None],
                "models_from": "/v1/models"}
    if member.models:
        return {"models": list(member.models), "models_from": "registration"}
    return {"models": [], "models_from": "not answered yet: serves no model"}


def reads_kv_index(settings: Settings, tables: Tables) -> bool:
    """Whether a policy (the proxy's or a model table's) or the prefill bypass reads the KV
    index (else none is made)."""
    policies = [settings.prefill_policy, settings.decode_policy]
    for table in tables.pools.values():
        policies += [table.settings.get("prefill_policy"), table.settings.get("decode_policy")]
    return settings.pd_uncached_token_threshold > 0 or "precise_cache_aware" in policies


def _log_health_change(state: Any) -> None:
    if state.live:
        log.info("%s instance %s is back in rotation", state.stage, state.url)
    else:
        log.warning("%s instance %s left the rotation after %d consecutive failure(s)",
                    state.stage, state.url, state.consecutive_failures)
