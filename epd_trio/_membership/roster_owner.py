"""Who is in the roster: the one object that changes it, and the one place a new version is pulled.

``Membership`` owns the roster store (``_state/roster_store``: this process's, the shared memory
of ``epd-trio serve --workers N``, or a replica's view of ``EPD_STATE_URL``) and every way an
instance joins or leaves it: HTTP registrations, the discovery sources (``_discovery``), the
MoRIIO registration listener, and expiry. The request path (the ``Proxy``, its cursors, health
states and pools) only reads the roster, and only by pulling it (``pull``).

Why pull and not push: the store used to call the proxy back with each new version, and for
the shared store that call came from inside a routing counter's step, halfway through a
cursor's decision; every cursor then re-checked whether its list had changed under it, and the
proxy sprinkled ``poll()`` calls wherever it read the roster. Now a new version waits in the
store as data (``seen``) until one of a few known points asks for it, as h11's
``next_event()`` waits to be called: the top of a client request, the top of an admin or
read-only route, a housekeeping round, and a cursor whose counter step belongs to a newer
version than its list (``_state/cursors.Follow``). ``pull`` returns the new roster when its
version moved and None otherwise; with no change it costs one word read (the shared store's
version) or less.

Who waits for a change (``wait_change``) is woken when this object changes the roster, when a
pull finds a new version, and when a replica's sync task changed its view
(``ReplicatedRoster.on_change``); a change made by another worker of ``--workers N`` is seen at
that worker's next pull here, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from .._core.config import Settings
from .._core.counters import LocalPoolCounters, PoolCounters
from .._core.discovery import Discovered, is_dns_url
from .._core.errors import BadRequest
from .._core.moriio import MoriioRegistration
from .._core.names import STAGES
from .._core.roster import (
    Roster,
    Served,
    expired,
    forget,
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
from .._discovery.start import discovery_sources
from .._models.pools import set_served, with_pool_epochs
from .._models.tables import PoolTable
from .._replicas.roster import ReplicatedRoster
from .._state.roster_store import Change, RosterStore
from .._state.tasks import named
from .moriio_listener import RegistrationListener

T = TypeVar("T")
log = logging.getLogger("epd_trio")


class Membership:
    """The roster's owner: its store, registrations, discovery, MoRIIO and expiry.

    ``start(nursery)`` binds the MoRIIO registration socket (when this process has one) and
    ``start_discovery(nursery)`` runs the discovery sources, each having found its instances
    once; ``close()`` stops the listener (the discovery tasks end with the nursery they run in).
    """

    def __init__(
        self, settings: Settings, store: RosterStore, *, moriio_listener: bool = True,
        discovery: bool = True, clock: Callable[[], float] = time.monotonic,
        pool_tables: Mapping[str, PoolTable] | None = None,
        pool_counters: PoolCounters | None = None,
    ) -> None:
        """``store`` starts with the static configuration (``settings``' listed instances).

        ``moriio_listener``: with ``EPD_KV_CONNECTOR=moriio``, whether this process binds the
        registration socket (one worker of ``epd-trio serve --workers N`` does; the shared
        roster carries the registrations to the others). ``discovery``: whether this process
        runs the DNS and Kubernetes discovery loops (likewise one worker). ``clock`` stamps
        MoRIIO registrations and judges their silence (tests pass trio's virtual clock).
        ``pool_tables`` and ``pool_counters``: the model tables and the pools' counters, from
        which every change computes the pools' epochs (``_models/pools``)."""
        self.settings = settings
        self._tables = pool_tables or {}
        self._pool_counters = pool_counters or LocalPoolCounters()
        self.clock = clock
        self._store = store
        self._replicated = settings.state_url is not None
        self._followed: Roster | None = None
        self._changed = trio.Event()
        #: The ``host:port`` the MoRIIO registration socket is bound to, once it is.
        self.moriio_endpoint: str | None = None
        #: The ZMQ registration listener (``EPD_KV_CONNECTOR=moriio`` in the process that binds).
        self.moriio_listener: RegistrationListener | None = None
        if settings.kv_connector == "moriio" and moriio_listener:
            self.moriio_listener = RegistrationListener(
                settings.moriio_registration, register=self.register_moriio,
                expire=self.expire_moriio, ttl=settings.moriio_ttl, clock=clock)
        self._listener_scope: trio.CancelScope | None = None
        #: The discovery sources this process runs (``_discovery``).
        self.discovery = discovery_sources(
            settings, self.discovered, registered=self._registered_names,
            apply_registered=partial(self.discovered, registered=True)) if discovery else []
        #: Where a changed pool starts its rotation: a random slot with replicas sharing the
        #: store (``with_pool_epochs``), else where it left off.
        self._pool_offset: Callable[[int], int] | None = None
        if isinstance(store, ReplicatedRoster):
            store.on_change = self._wake  # the sync task changed the view: wake the waiters
            store.refine = self._with_pools
            self._pool_offset = store.offset
        static = static_roster(settings.listed("encode"), settings.listed("prefill"),
                               settings.listed("decode"))
        store.attach(self._with_pools(static, static, {}))

    # -- the pull ------------------------------------------------------------------------------
    @property
    def roster(self) -> Roster:
        """The roster last pulled: the one the request path follows."""
        assert self._followed is not None, "pull() before reading the roster"
        return self._followed

    def pull(self, *, look: bool = True) -> Roster | None:
        """The newest roster when its version moved since the last pull, else None.

        ``look``: ask the store first (for the shared store, one unlocked word read). A cursor
        catching up after its counter step passes False: it follows the roster that step
        recorded, not a newer one another worker made since, so that the value it took and
        the list it maps it over belong together. Its one caller is the owner of the request
        path (``Proxy.sync``), which follows what it returns everywhere at once.
        """
        roster = self._store.look() if look else self._store.seen
        if self._followed is not None and roster.version == self._followed.version:
            return None
        self._followed = roster
        self._wake()
        return roster

    def current(self) -> Roster:
        """The roster as the store holds it now, registration times included (``GET
        /instances``); it does not count as a pull."""
        return self._store.current()

    async def wait_change(self) -> None:
        """Until the roster may have changed (a change made here, a pull that found one, a
        replica's sync task): the caller pulls, then looks again."""
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _with_pools(self, old: Roster, new: Roster, counters: Mapping[str, int]) -> Roster:
        """``new`` with its pools' epochs (``_models/pools.with_pool_epochs``): every change of
        every store passes here, under the store's lock for the shared one."""
        return with_pool_epochs(old, new, self._tables, self._pool_counters.peek,
                                self._pool_offset)

    def _update(self, change: Change[T]) -> T:
        """Every change goes through here: the store makes it, the pools follow it; waiters
        are woken when the version moved (the request path sees it at its next pull)."""
        before = self._store.seen.version

        def with_pools(roster: Roster, counters: Mapping[str, int]) -> tuple[Roster, T]:
            new, result = change(roster, counters)
            return self._with_pools(roster, new, counters), result

        result = self._store.update(with_pools)
        if self._store.seen.version != before:
            self._wake()
        return result

    # -- registrations ---------------------------------------------------------------------------
    def register(self, raw_body: bytes) -> bool:
        """``POST /instances``: add or refresh an instance; True when it was new.

        Raises ``BadRequest`` (400) for a bad body or a prefill_decode / prefill+decode mix,
        ``Conflict`` (409) for a known URL changing its role.
        """
        name = parse_name_registration(raw_body)
        if name is not None:
            role, dns_name = name
            if self._replicated:
                # Discovered instances are each replica's own, not shared through the store:
                # a name registered with one replica would serve that replica alone.
                raise BadRequest("with a shared roster (EPD_STATE_URL) a DNS name is configured "
                                 "on every replica (EPD_DECODE_URLS=dns+http://...), not "
                                 "registered with one")
            return self._update(
                lambda roster, counters: register_name(roster, role, dns_name.spec))
        member = parse_registration(raw_body, time.monotonic())
        created = self._update(lambda roster, counters: register(roster, member, counters))
        if created:
            log.info("%s instance %s registered (dp_size %d)", member.role, member.url,
                        member.instance.dp_size)
        return created

    def unregister(self, url: object) -> bool:
        """``DELETE /instances``: remove the instance at ``url``; True when it was there."""
        if isinstance(url, str) and url.startswith(("dns ", "dnssrv ")):
            url = url.replace(" ", "+", 1)  # an unencoded '+' in the query became a space
        if isinstance(url, str) and is_dns_url(url):
            spec = url.strip()
            removed = self._update(
                lambda roster, counters: unregister_name(roster, spec, counters))
            if removed:
                log.info("DNS name %s unregistered", spec)
            return removed
        target = parse_instance_url(url).url
        removed = self._update(lambda roster, counters: unregister(roster, target, counters))
        if removed:
            log.info("instance %s unregistered", target)
        return removed

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

        # Most rounds change nothing: check on the newest roster this process has seen first,
        # so that they never take the shared lock the routing counters use (a change missed
        # because another worker changed the roster meanwhile is made at the next round).
        seen = self._store.look()
        if change(seen, dict.fromkeys(STAGES, 0))[0] is seen:
            return [], []
        return self._update(change)

    def _registered_names(self) -> tuple[tuple[str, str], ...]:
        return self._store.look().names

    def learned(self, answers: Mapping[str, Served]) -> None:
        """What instances answered to ``GET /v1/models`` (``_models/learner``): a new roster
        version when a pool changed, none when every answer was the same as before."""
        seen = self._store.look()
        if set_served(seen, answers) is seen:
            return  # the common round: nothing new, and no shared lock taken
        self._update(lambda roster, counters: (set_served(roster, answers), None))

    def register_moriio(self, registration: MoriioRegistration, now: float) -> bool:
        """A MoRIIO heartbeat: add or refresh the instance; True when it was new. Raises
        ``RegistrationRefused`` (the other transfer mode, a role change)."""
        created = self._update(
            lambda roster, counters: register_moriio(roster, registration, counters, now))
        if created:
            log.info("MoRIIO %s instance %s registered (dp_size %d, tp_size %d, %s, zmq %s)",
                        registration.role, registration.instance.url,
                        registration.peer.dp_size, registration.peer.tp_size,
                        registration.transfer_mode, registration.peer.zmq_address)
        return created

    # -- expiry ------------------------------------------------------------------------------------
    def expire_moriio(self, now: float) -> list[str]:
        """Forget the MoRIIO instances silent for ``moriio_ttl`` (they beat every 3 s).

        With a shared state store their entries expire there instead (``_replicas/sync``): a
        replica that cannot reach the store keeps its last view."""
        if self._replicated:
            return []
        ttl = self.settings.moriio_ttl

        def change(roster: Roster, counters: Any) -> tuple[Roster, list[str]]:
            urls = silent_moriio(roster, now, ttl)
            return forget(roster, urls, counters), urls

        urls = self._update(change)
        for url in urls:
            log.warning("MoRIIO instance %s left the rotation: silent for %g s", url, ttl)
        return urls

    def expire(self, evicted: Mapping[str, float], now: float | None = None) -> list[str]:
        """Forget the registered instances that have been out of rotation (``evicted``: since
        when, in this worker's health view) and silent for ``instance_ttl``, judged on the
        shared roster.

        With a shared state store, entries expire there instead (``_replicas/sync``)."""
        if not evicted or self._replicated:
            return []
        now = time.monotonic() if now is None else now
        ttl = self.settings.instance_ttl

        def change(roster: Roster, counters: Any) -> tuple[Roster, list[str]]:
            urls = expired(roster, evicted, now, ttl)
            return forget(roster, urls, counters), urls

        urls = self._update(change)
        for url in urls:
            log.info("instance %s forgotten: out of rotation and not registered for %g s",
                        url, ttl)
        return urls

    # -- the tasks ---------------------------------------------------------------------------------
    async def start(self, nursery: trio.Nursery) -> None:
        """Bind the MoRIIO registration socket in ``nursery`` (when this process has one):
        before the app serves, so a port in use fails start-up with an OSError."""
        if self.moriio_listener is not None:
            self._listener_scope = trio.CancelScope()
            self.moriio_endpoint = await nursery.start(
                named("MoRIIO listener", self._run_listener), self._listener_scope)

    async def start_discovery(self, nursery: trio.Nursery) -> None:
        """Start each discovery source in ``nursery``; each finds its instances once first."""
        for source in self.discovery:
            await nursery.start(named(type(source).__name__, source.run))

    def close(self) -> None:
        """Stop the MoRIIO listener (nothing else here runs on its own)."""
        if self._listener_scope is not None:
            self._listener_scope.cancel()
            self._listener_scope = None

    async def _run_listener(
        self, scope: trio.CancelScope, task_status: trio.TaskStatus[str]
    ) -> None:
        """The MoRIIO registration listener, until ``close`` cancels ``scope``."""
        assert self.moriio_listener is not None
        with scope:
            await self.moriio_listener.run(task_status=task_status)
