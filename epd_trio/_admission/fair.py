"""Fair admission: the cap on requests in flight shared by tenants, their own limits, and the
queue over the cap (priority bands, weighted turns, aging: ``_core/fair_queue.py``).

Why here and not in the pipeline: like ``gate.Admission``, a place is taken before the body is
read (the cap bounds memory), and the tenant is known from the head alone (its key, or
``EPD_TENANT_HEADER``). The limits that need the body (the client's ``priority``, the token
reservation) are applied by the request's ``Ticket`` once the pipeline has parsed it, so the
body is parsed once.

Order of checks: a place (a free one, or a wait in the queue up to ``EPD_ADMISSION_TIMEOUT``:
503, or 429 naming ``max_inflight`` when the tenant's own cap is what held it), then, on the
parsed body, ``requests_per_minute`` and ``tokens_per_minute`` together, all or nothing (429
naming the first that does not fit). Together, because with ``EPD_STATE_URL`` the buckets
live in Redis and an admission costs one round trip at most (one script, which also takes the
tenant's place among its places at every replica: ``leases``); when Redis does not answer,
each replica enforces its share of each limit (``limit / live replicas``) on its own,
counted, and no request fails for it.

Release: the place (and the tenant's count) is held until the request's resources close, then
the queue is asked who gets it (``FairQueue.pop``), skipping tenants at their own cap, so no
place stays idle while someone who may use it waits. A ticket settles its token reservation
on its usage when the request ends, however it ends.

Workers and replicas: the places (``EPD_MAX_INFLIGHT``) and the queue are this process's; a
tenant's ``max_inflight`` is counted by every worker of ``epd-trio serve --workers N``
(``places``: one locked take-if-below-the-cap), or by every replica (``leases``: the store's,
exact; the others' published counts are only a hint that keeps futile waiters from asking).
No event crosses processes, so ``follow_workers`` looks at the workers' counts every
``WORKERS_RECHECK`` seconds while anyone waits here, and a replica's waiters held by the
store ask again at its next read of the others' counts (``refresh``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol

import trio

from .._core.auth import bearer_token, first_header
from .._core.errors import AtCapacity, RateLimited
from .._core.fair_queue import FairQueue, Waiter
from .._core.tenants import (
    Tenant,
    TenantTable,
    effective_priority,
    prompt_estimate,
    token_reservation,
    tokens_used,
    with_priority,
)
from .._core.token_bucket import TokenBucket, retry_after
from .._core.tracing import usage_of

Clock = Callable[[], float]
#: Seconds between two looks at the other workers' counts while anyone waits here
#: (``SharedPlaces``): a waiter whose place another worker freed starts within this.
WORKERS_RECHECK = 0.025
#: One limit a request asks of: (its name, the tenant's per-minute value, the amount).
Want = tuple[str, int, int]
#: What ``SharedBuckets.take`` answers in place of a want's index when the tenant holds all
#: its places across the replicas.
PLACES_HELD = -1


class AdmissionObserver(Protocol):
    """Who counts what admission does (``_observe/metrics.ProxyMetrics``)."""

    def tenant_queued(self, tenant: str, priority: int, delta: int) -> None: ...
    def tenant_admitted(self, tenant: str, priority: int, waited: float) -> None: ...
    def tenant_headroom(self, tenant: str, priority: int) -> None: ...
    def tenant_rejected(self, tenant: str, priority: int, reason: str) -> None: ...
    def tenant_settled(self, tenant: str, priority: int, tokens: int) -> None: ...


class SharedBuckets(Protocol):
    """The tenants' per-minute buckets shared by replicas (``_replicas/limits``)."""

    #: Replicas alive at the last look (the share each enforces while the store is gone).
    live_replicas: int

    def others_inflight(self, tenant: str) -> int:
        """The tenant's requests in flight elsewhere (other replicas, as last published)."""
        ...

    async def take(self, tenant: str, wants: Sequence[Want],
                   place: tuple[int, bytes] | None = None) -> tuple[int, float] | None:
        """All of ``wants`` taken at once, and with ``place`` (the tenant's ``max_inflight``
        and this request's lease) one of the tenant's places: ``(0, 0.0)``; or
        ``(PLACES_HELD, held)``; or the 1-based index of the first want that does not fit and
        its wait; nothing taken unless all is; None: the store did not answer."""
        ...

    def settle(self, tenant: str, limit: str, per_minute: int, delta: int) -> bool:
        """Give ``delta`` back (negative: take it) without waiting; False: not sent."""
        ...

    def fell_back(self) -> None:
        """Counts one decision taken on the local share."""
        ...


class PlaceLeases(Protocol):
    """The capped tenants' places held at every replica, as leases in the shared store
    (``_replicas/limits``), taken by ``SharedBuckets.take`` with ``place``."""

    @property
    def up(self) -> bool:
        """Whether the store answers (else each replica decides on its share)."""
        ...

    def new_lease(self) -> bytes:
        """A lease no other request of any replica holds."""
        ...

    def give(self, tenant: str, lease: bytes) -> None:
        """The lease's place is free again (or was never taken), without waiting."""
        ...


class SharedPlaces(Protocol):
    """The capped tenants' requests in flight, counted by every worker of one
    ``epd-trio serve --workers N`` (``_state/tenant_places``)."""

    def count(self, tenant: str) -> int:
        """The tenant's requests in flight in every worker."""
        ...

    def take(self, tenant: str, cap: int) -> bool:
        """One place of the tenant's ``cap``, taken only if fewer are in flight (atomic)."""
        ...

    def give(self, tenant: str) -> None:
        """A place taken by ``take`` is free again."""
        ...


class Ticket:
    """One admitted request's side of its tenant's limits: the body's priority and token
    reservation (``admitted``), and the settlement of what it used (``settle``)."""

    __slots__ = ("_admission", "_events", "_prompt", "_reserved", "_settled", "_usage",
                 "deadline", "holds_place", "lease", "local_share", "priority", "queued",
                 "tenant")

    def __init__(self, admission: FairAdmission, tenant: Tenant, deadline: float) -> None:
        self._admission = admission
        self.tenant = tenant
        self.priority = tenant.priority
        #: When its wait for a place ends (``EPD_ADMISSION_TIMEOUT`` after it came, on trio's
        #: clock), however
        #: many times it waits: once for this process's place, again if the shared store
        #: finds its tenant's places all held.
        self.deadline = deadline
        #: Whether it holds one of this process's places (given back when it closes).
        self.holds_place = False
        #: Its place among its tenant's places at every replica (``PlaceLeases``), once taken.
        self.lease: bytes | None = None
        #: Seconds it waited in the queue for a place, every wait summed (the request log's
        #: ``queued_s``: its trace starts when it is admitted).
        self.queued = 0.0
        #: Where its per-minute amounts were taken: None, the shared store; else this
        #: process's buckets of ``limit / local_share`` (settled there, ``settle_tokens``).
        self.local_share: int | None = None
        self._reserved = 0
        self._prompt = 0
        self._events = 0
        self._usage: tuple[int, int] | None = None
        self._settled = False

    @property
    def metered(self) -> bool:
        """Whether the request's tokens are counted (its tenant has ``tokens_per_minute``)."""
        return self.tenant.tokens_per_minute is not None

    async def admitted(self, body: dict[str, Any]) -> dict[str, Any]:
        """The parsed ``body`` at its effective priority, its request and tokens counted;
        ``RateLimited`` when a per-minute bucket of its tenant holds too few."""
        self.priority = effective_priority(self.tenant, body)
        tenant = self.tenant
        wants: list[Want] = []
        if tenant.requests_per_minute is not None:
            wants.append(("requests_per_minute", tenant.requests_per_minute, 1))
        reserved = 0
        if tenant.tokens_per_minute is not None:
            reserved = token_reservation(body)
            wants.append(("tokens_per_minute", tenant.tokens_per_minute, reserved))
        if wants or self._admission.leases_places(tenant):
            await self._admission.take(self, wants)
            self._reserved, self._prompt = reserved, prompt_estimate(body)
        return with_priority(body, self.priority)

    def answered(self, data: bytes) -> None:
        """The answer's JSON body, or its stream's tail: its ``usage``, when reported."""
        if self._reserved:
            self._usage = usage_of(data) or self._usage

    def relayed(self, chunk: bytes) -> None:
        """Stream bytes sent to the client: what a stream without ``usage`` used."""
        self._events += chunk.count(b"data: {")

    def close(self) -> None:
        """The request is over: its reservation settled on what it used, its places given
        back (once)."""
        if self._settled:
            return
        self._settled = True
        admission = self._admission
        if self._reserved:
            used = tokens_used(self._prompt, self._usage, self._events)
            admission.settle_tokens(self.tenant, self.priority, self._reserved, used,
                                    self.local_share)
        if self.lease is not None:
            admission.give_lease(self.tenant, self.lease)
            self.lease = None
        if self.holds_place:
            self.holds_place = False
            admission.release(self.tenant)


class FairAdmission:
    """One proxy's fair gate: ``max_inflight`` places shared by the tenants of ``table``."""

    def __init__(self, *, max_inflight: int, timeout: float, table: TenantTable,
                 aging: float, tenant_header: str | None = None,
                 clock: Clock = trio.current_time, shared: SharedBuckets | None = None,
                 places: SharedPlaces | None = None, leases: PlaceLeases | None = None,
                 observer: AdmissionObserver | None = None, headroom: int = 0) -> None:
        self._max = max_inflight
        #: Places above ``max_inflight`` that only a band better than one in flight may take
        #: (``EPD_PRIORITY_HEADROOM``, ``_has_place``).
        self._headroom = headroom
        self._timeout = timeout
        self._table = table
        self._header = None if tenant_header is None else tenant_header.encode("latin-1")
        self._clock = clock
        self._queue = FairQueue(aging)
        self._inflight = 0
        self._per_tenant: dict[str, int] = {}
        self._buckets: dict[tuple[str, str, float], TokenBucket] = {}
        self._shared = shared
        self._places = places
        self._leases = leases
        #: Capped tenants the shared store found holding all their places since the others'
        #: counts were last read: held here until the next read (``refresh``), so their
        #: waiters do not ask the store again and again before anything may have changed.
        self._held_elsewhere: set[str] = set()
        #: Set when a request starts to wait (``follow_workers`` sleeps on it while no one does).
        self._someone_waits = trio.Event()
        #: The tenants with a ``max_inflight``: the only ones a free place may skip.
        self._capped = [t for t in table.by_name.values() if t.max_inflight is not None]
        self._observer = observer

    # -- who ---------------------------------------------------------------------------------
    def tenant_of(self, headers: list[tuple[bytes, bytes]]) -> Tenant:
        """The tenant of a request's head: its key's, else its header's, else ``default``
        (each header's first value, as the key check reads it: ``first_header``)."""
        key = bearer_token(first_header(headers, b"authorization"))
        named = None if self._header is None else first_header(headers, self._header)
        return self._table.resolve(key, named)

    # -- places ------------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def across_workers(self) -> bool:
        """Whether the capped tenants' places are counted by several workers (``places``):
        then ``follow_workers`` must run."""
        return self._places is not None

    def depth(self) -> Mapping[tuple[str, int], int]:
        """Waiters per (tenant, band)."""
        return self._queue.depth()

    async def enter(self, tenant: Tenant, resources: AsyncExitStack) -> Ticket:
        """Admit a request of ``tenant`` (released when ``resources`` close); its ticket."""
        ticket = Ticket(self, tenant, trio.current_time() + self._timeout)
        ticket.queued = await self._take_place(tenant, ticket.deadline)
        ticket.holds_place = True
        resources.callback(ticket.close)
        return ticket

    def leases_places(self, tenant: Tenant) -> bool:
        """Whether ``tenant``'s places are leased in the shared store (its ``max_inflight``,
        with ``EPD_STATE_URL``)."""
        return self._leases is not None and tenant.max_inflight is not None

    def _cap_here(self, tenant: Tenant) -> int:
        """The tenant's ``max_inflight`` as this process enforces it: whole, or while the
        shared store does not answer, this replica's share of it (at least 1: a tenant is
        never shut out, so with more live replicas than places the fleet may hold up to one
        per replica)."""
        leases = self._leases
        if leases is None or leases.up:
            return tenant.max_inflight or 0
        return self._share_of(tenant)

    def _share_of(self, tenant: Tenant) -> int:
        return max(1, (tenant.max_inflight or 0) // self._share())

    def _at_cap(self, tenant: Tenant) -> bool:
        name = tenant.name
        if name in self._held_elsewhere and self._leases is not None and self._leases.up:
            return True
        return self._tenant_inflight(name) >= self._cap_here(tenant)

    def _try_start(self, tenant: Tenant) -> bool:
        """Start a request of ``tenant`` if this process has a place and its tenant is under
        its cap; with ``places``, the cap's place is taken in one locked step, so two
        workers never both take the last one."""
        if not self._has_place(tenant.priority):
            return False
        cap, name = tenant.max_inflight, tenant.name
        if cap is not None:
            if self._places is not None:
                if not self._places.take(name, cap):
                    return False
            elif self._at_cap(tenant):
                return False
        self._start(tenant)
        return True

    def _has_place(self, band: int) -> bool:
        """Whether a request of ``band`` may start here: in one of the ``max_inflight``
        places, or in the headroom above them, which only a band better than one in flight
        may take. Without it a request of the best band waits outside the engine until a
        place frees, however the engine schedules (``--scheduling-policy priority`` can only
        preempt for a request it holds); with it the engine holds it at once, and the band
        it outranks refills only once the total is back under the cap."""
        if self._inflight < self._max:
            return True
        return self._inflight < self._max + self._headroom and band < self._worst_band()

    def _worst_band(self) -> int | float:
        """The largest priority number among this process's requests in flight (read only at
        the cap, so derived from the per-tenant counts rather than kept per band)."""
        by_name = self._table.by_name
        return max((by_name[name].priority for name, n in self._per_tenant.items() if n),
                   default=-math.inf)

    def _outranking_none(self) -> set[str]:
        """The tenants that may not take the headroom now: none of their band's better than
        every band in flight."""
        worst = self._worst_band()
        return {name for name, tenant in self._table.by_name.items() if tenant.priority >= worst}

    def _tenant_inflight(self, name: str) -> int:
        """The tenant's requests in flight: in every worker (``places``); or here, and at
        the other replicas as they last published them (``EPD_STATE_LOAD_INTERVAL``): a hint
        that keeps futile waiters from asking the store, whose leases decide
        (``Ticket.admitted``)."""
        if self._places is not None:
            return self._places.count(name)
        here = self._per_tenant.get(name, 0)
        return here if self._shared is None else here + self._shared.others_inflight(name)

    def per_tenant(self) -> Mapping[str, int]:
        """This process's requests in flight per tenant (published to the other replicas)."""
        return {name: n for name, n in self._per_tenant.items() if n}

    def _start(self, tenant: Tenant) -> None:
        name = tenant.name
        if self._inflight >= self._max and self._observer is not None:
            self._observer.tenant_headroom(name, tenant.priority)
        self._inflight += 1
        self._per_tenant[name] = self._per_tenant.get(name, 0) + 1

    async def _take_place(self, tenant: Tenant, deadline: float, *, again: bool = False
                          ) -> float:
        """One of this process's places for ``tenant`` by ``deadline`` (trio's clock), and
        how long it waited in the queue for it; ``again``: its request was admitted once
        already (counted then), and lost the place to the shared store's leases."""
        observer, name, band = self._observer, tenant.name, tenant.priority
        # Every release hands its place to the queue first, so a free place means that every
        # waiter is held by its own tenant's cap: a newcomer that may start jumps no one.
        if self._try_start(tenant):
            if observer is not None and not again:
                observer.tenant_admitted(name, band, 0.0)
            return 0.0
        admitted = trio.Event()
        enqueued = self._clock()
        waiter = Waiter(tenant=name, priority=band, weight=tenant.weight, enqueued=enqueued,
                        token=admitted)
        self._queue.push(waiter)
        self._someone_waits.set()
        if observer is not None:
            observer.tenant_queued(name, band, 1)
        try:
            with trio.move_on_at(deadline):
                await admitted.wait()
        except BaseException:
            if admitted.is_set():  # the place came, but so did a cancellation: give it on
                self.release(tenant)
            else:
                waiter.cancelled = True
                if observer is not None:
                    observer.tenant_queued(name, band, -1)
            raise
        if admitted.is_set():
            waited = self._clock() - enqueued
            if observer is not None and not again:  # its queue count went down at its wake
                observer.tenant_admitted(name, band, waited)
            return waited
        waiter.cancelled = True
        cap = tenant.max_inflight
        held = cap is not None and self._at_cap(tenant)
        if observer is not None:
            observer.tenant_queued(name, band, -1)
            observer.tenant_rejected(name, band, "max_inflight" if held else "deadline")
        if held:
            assert cap is not None
            raise RateLimited(name, "max_inflight", cap, retry_after(self._timeout))
        raise AtCapacity(
            f"the proxy is serving its limit of {self._max} requests (EPD_MAX_INFLIGHT) and "
            f"no place came to tenant {name!r} within {self._timeout:g} s; retry later")

    def _blocked(self) -> set[str]:
        """Tenants at their own ``max_inflight``."""
        return {tenant.name for tenant in self._capped if self._at_cap(tenant)}

    def release(self, tenant: Tenant) -> None:
        """One of this process's places, held by a request of ``tenant``, is free again."""
        self._inflight -= 1
        self._per_tenant[tenant.name] -= 1
        if self._places is not None and tenant.max_inflight is not None:
            self._places.give(tenant.name)
        self.dispatch()

    def dispatch(self) -> None:
        """Give the free places to the queue (``FairQueue.pop``): after a release here, and
        when the other replicas' counts change (``refresh``)."""
        if not len(self._queue):
            return
        now = self._clock()
        lost: set[str] = set()
        while self._inflight < self._max + self._headroom:
            blocked = self._blocked() | lost
            if self._inflight >= self._max:  # only the headroom is left
                blocked |= self._outranking_none()
            waiter = self._queue.pop(now, blocked)
            if waiter is None:
                return
            if not self._try_start(self._table.by_name[waiter.tenant]):
                # Another worker took the tenant's last place since ``_blocked`` read it:
                # the waiter goes back to the head of its tenant's line, and its tenant is
                # skipped for the rest of this round.
                self._queue.requeue(waiter)
                lost.add(waiter.tenant)
                continue
            waiter.token.set()
            if self._observer is not None:
                self._observer.tenant_queued(waiter.tenant, waiter.priority, -1)

    def refresh(self) -> None:
        """The other replicas' counts were read again (or are lost with the store): a tenant
        the store found holding all its places may have one now, and its waiters try again."""
        self._held_elsewhere.clear()
        self.dispatch()

    async def follow_workers(
        self, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """While anyone waits here, look at the other workers' counts every
        ``WORKERS_RECHECK`` seconds: a place another worker frees wakes nobody here (there is
        no cross-process event), so a waiter it unblocks starts at the next look. One task
        per process (not per waiter), in the app's lifespan nursery, with ``places`` only;
        idle while no one waits. Reports the cancel scope that stops it."""
        with trio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                if not len(self._queue):
                    self._someone_waits = trio.Event()
                    await self._someone_waits.wait()
                await trio.sleep(WORKERS_RECHECK)
                self.dispatch()

    # -- rates -------------------------------------------------------------------------------
    def bucket(self, tenant: str, limit: str, per_minute: float) -> TokenBucket:
        """This process's bucket of one limit (``per_minute``: the limit, or the share of it
        this replica enforces while the shared store does not answer)."""
        key = (tenant, limit, per_minute)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket.full(per_minute, self._clock())
        return bucket

    async def take(self, ticket: Ticket, wants: Sequence[Want]) -> None:
        """Take every one of ``wants`` from the tenant's buckets, and with leased places
        (``leases_places``) one of the tenant's places, or none: ``RateLimited`` naming the
        first want that does not fit, with its bucket's ``Retry-After``. A tenant whose
        places are all held elsewhere gives this process's place back and waits for one
        again, up to the ticket's deadline (then 429 ``max_inflight``)."""
        tenant, shared, leases = ticket.tenant, self._shared, self._leases
        cap = tenant.max_inflight if leases is not None else None
        while True:
            lease = None if leases is None or cap is None else leases.new_lease()
            try:
                answer = None if shared is None else await shared.take(
                    tenant.name, wants, None if lease is None else (cap or 0, lease))
            except BaseException:
                # Cancelled mid round trip (the client left, the drain cut it): the lease is
                # held from the take on, and renewed until given back, whether or not the
                # store's script ran; given back here, it cannot hold a place for ever.
                if lease is not None:
                    self.give_lease(tenant, lease)
                raise
            local_share = None
            if answer is None:
                if shared is not None:
                    shared.fell_back()
                if lease is not None and self._per_tenant[tenant.name] > self._share_of(tenant):
                    # The store is up but slow: the place is decided on this replica's share
                    # (gone, the store's places already were: ``_cap_here``).
                    self.give_lease(tenant, lease)
                    await self._wait_again(ticket)
                    continue
                local_share = self._share()
                answer = self._take_locally(tenant.name, wants, local_share)
            index, wait = answer
            if index == 0:
                ticket.lease = lease
                ticket.local_share = local_share
                return
            if lease is not None:
                self.give_lease(tenant, lease)
            if index == PLACES_HELD:
                await self._wait_again(ticket)
                continue
            limit, per_minute, _ = wants[index - 1]
            if self._observer is not None:
                self._observer.tenant_rejected(tenant.name, tenant.priority, limit)
            raise RateLimited(tenant.name, limit, per_minute, retry_after(wait))

    async def _wait_again(self, ticket: Ticket) -> None:
        """The shared store found ``ticket``'s tenant holding all its places, though the
        counts here said otherwise (they lag by up to ``EPD_STATE_LOAD_INTERVAL``): this
        process's place goes to someone who may use it, and the ticket waits for a place
        again until its deadline."""
        tenant = ticket.tenant
        self._held_elsewhere.add(tenant.name)
        ticket.holds_place = False
        self.release(tenant)
        ticket.queued += await self._take_place(tenant, ticket.deadline, again=True)
        ticket.holds_place = True

    def give_lease(self, tenant: Tenant, lease: bytes) -> None:
        assert self._leases is not None
        self._leases.give(tenant.name, lease)

    def _share(self) -> int:
        return 1 if self._shared is None else max(1, self._shared.live_replicas)

    def _take_locally(self, tenant: str, wants: Sequence[Want],
                      share: int) -> tuple[int, float]:
        now = self._clock()
        buckets = [self.bucket(tenant, limit, per_minute / share)
                   for limit, per_minute, _ in wants]
        for index, (bucket, (_, _, amount)) in enumerate(zip(buckets, wants, strict=True)):
            wait = bucket.wait_for(amount, now)
            if wait:
                return index + 1, wait
        for bucket, (_, _, amount) in zip(buckets, wants, strict=True):
            bucket.take(amount, now)
        return 0, 0.0

    def settle_tokens(self, tenant: Tenant, band: int, reserved: int, used: int,
                      local_share: int | None) -> None:
        """Settle in the bucket that took the reservation: the shared store's
        (``local_share`` None), else this process's bucket of that share. A store that went
        away since keeps the whole reservation, which errs on the side of the limit;
        settling here instead would credit a bucket that was never charged."""
        if self._observer is not None:
            self._observer.tenant_settled(tenant.name, band, used)
        per_minute = tenant.tokens_per_minute
        assert per_minute is not None
        if local_share is None:
            if self._shared is not None:
                self._shared.settle(tenant.name, "tokens_per_minute", per_minute,
                                    reserved - used)
            return
        self.bucket(tenant.name, "tokens_per_minute", per_minute / local_share).settle(
            reserved, used, self._clock())
