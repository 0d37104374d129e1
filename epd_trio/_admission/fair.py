"""Fair admission: the cap on requests in flight shared by tenants, their own limits, and the
queue over the cap (priority bands, weighted turns, aging: ``_core/fair_queue.py``).

Why here and not in the pipeline: like ``gate.Admission``, a place is taken before the body is
read (the cap bounds memory), and the tenant is known from the head alone (its key, or
``EPD_TENANT_HEADER``). The limits that need the body (the client's ``priority``, the token
reservation) are applied by the request's ``Ticket`` once the pipeline has parsed it, so the
body is parsed once.

Order of checks, each answering at once: ``requests_per_minute`` (429), then a place (a free
one, or a wait in the queue up to ``EPD_ADMISSION_TIMEOUT``: 503, or 429 naming
``max_inflight`` when the tenant's own cap is what held it), then ``tokens_per_minute`` (429)
on the parsed body. A request refused after taking a request unit gives it back.

Release: the place (and the tenant's count) is held until the request's resources close, then
the queue is asked who gets it (``FairQueue.pop``), skipping tenants at their own cap, so no
place stays idle while someone who may use it waits. A ticket settles its token reservation
on its usage when the request ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any

import trio

from .._core.auth import bearer_token
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


class Ticket:
    """One admitted request's side of its tenant's limits: the body's priority and token
    reservation (``admitted``), and the settlement of what it used (``settle``)."""

    __slots__ = ("_admission", "_events", "_prompt", "_reserved", "_settled", "_usage",
                 "priority", "tenant")

    def __init__(self, admission: FairAdmission, tenant: Tenant) -> None:
        self._admission = admission
        self.tenant = tenant
        self.priority = tenant.priority
        self._reserved = 0
        self._prompt = 0
        self._events = 0
        self._usage: tuple[int, int] | None = None
        self._settled = False

    @property
    def metered(self) -> bool:
        """Whether the request's tokens are counted (its tenant has ``tokens_per_minute``)."""
        return self.tenant.tokens_per_minute is not None

    def admitted(self, body: dict[str, Any]) -> dict[str, Any]:
        """The parsed ``body`` at its effective priority, its tokens reserved; ``RateLimited``
        when the tenant's ``tokens_per_minute`` bucket holds too few."""
        self.priority = effective_priority(self.tenant, body)
        if self.metered:
            reserved = token_reservation(body)
            try:
                self._admission.reserve_tokens(self.tenant, reserved)
            except RateLimited:
                self._admission.settle_requests(self.tenant)  # refused: the request unit back
                raise
            self._reserved, self._prompt = reserved, prompt_estimate(body)
        return with_priority(body, self.priority)

    def answered(self, data: bytes) -> None:
        """The answer's JSON body, or its stream's tail: its ``usage``, when reported."""
        if self._reserved:
            self._usage = usage_of(data) or self._usage

    def relayed(self, chunk: bytes) -> None:
        """Stream bytes sent to the client: what a stream without ``usage`` used."""
        self._events += chunk.count(b"data: {")

    def settle(self) -> None:
        """The request is over: its reservation settled on what it used (once)."""
        if self._settled:
            return
        self._settled = True
        if self._reserved:
            used = tokens_used(self._prompt, self._usage, self._events)
            self._admission.settle_tokens(self.tenant, self._reserved, used)


class FairAdmission:
    """One proxy's fair gate: ``max_inflight`` places shared by the tenants of ``table``."""

    def __init__(self, *, max_inflight: int, timeout: float, table: TenantTable,
                 aging: float, tenant_header: str | None = None,
                 clock: Clock = trio.current_time) -> None:
        self._max = max_inflight
        self._timeout = timeout
        self._table = table
        self._header = None if tenant_header is None else tenant_header.encode("latin-1")
        self._clock = clock
        self._queue = FairQueue(aging)
        self._inflight = 0
        self._per_tenant: dict[str, int] = {}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    # -- who ---------------------------------------------------------------------------------
    def tenant_of(self, headers: list[tuple[bytes, bytes]]) -> Tenant:
        """The tenant of a request's head: its key's, else its header's, else ``default``."""
        key = named = None
        for name, value in headers:
            if name == b"authorization":
                key = bearer_token(value.decode("latin-1"))
            elif name == self._header:
                named = value.decode("latin-1")
        return self._table.resolve(key, named)

    # -- places ------------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self._inflight

    def depth(self) -> Mapping[tuple[str, int], int]:
        """Waiters per (tenant, band)."""
        return self._queue.depth()

    async def enter(self, tenant: Tenant, resources: AsyncExitStack) -> Ticket:
        """Admit a request of ``tenant`` (released when ``resources`` close); its ticket."""
        self._take_request(tenant)
        try:
            await self._take_place(tenant)
        except BaseException:
            self.settle_requests(tenant)
            raise
        resources.callback(self._release, tenant)
        ticket = Ticket(self, tenant)
        resources.callback(ticket.settle)
        return ticket

    def _may_start(self, tenant: Tenant) -> bool:
        cap = tenant.max_inflight
        return self._inflight < self._max and (
            cap is None or self._per_tenant.get(tenant.name, 0) < cap)

    def _start(self, name: str) -> None:
        self._inflight += 1
        self._per_tenant[name] = self._per_tenant.get(name, 0) + 1

    async def _take_place(self, tenant: Tenant) -> None:
        # Every release hands its place to the queue first, so a free place means that every
        # waiter is held by its own tenant's cap: a newcomer that may start jumps no one.
        if self._may_start(tenant):
            self._start(tenant.name)
            return
        admitted = trio.Event()
        waiter = Waiter(tenant=tenant.name, priority=tenant.priority, weight=tenant.weight,
                        enqueued=self._clock(), token=admitted)
        self._queue.push(waiter)
        try:
            with trio.move_on_after(self._timeout):
                await admitted.wait()
        except BaseException:
            if admitted.is_set():  # the place came, but so did a cancellation: give it on
                self._release(tenant)
            else:
                waiter.cancelled = True
            raise
        if admitted.is_set():
            return
        waiter.cancelled = True
        cap = tenant.max_inflight
        if cap is not None and self._per_tenant.get(tenant.name, 0) >= cap:
            raise RateLimited(tenant.name, "max_inflight", cap, retry_after(self._timeout))
        raise AtCapacity(
            f"the proxy is serving its limit of {self._max} requests (EPD_MAX_INFLIGHT) and "
            f"no place came to tenant {tenant.name!r} within {self._timeout:g} s; retry later")

    def _blocked(self) -> set[str]:
        """Tenants at their own ``max_inflight``."""
        by_name = self._table.by_name
        return {name for name, n in self._per_tenant.items()
                if (cap := by_name[name].max_inflight) is not None and n >= cap}

    def _release(self, tenant: Tenant) -> None:
        self._inflight -= 1
        self._per_tenant[tenant.name] -= 1
        if not len(self._queue):
            return
        now = self._clock()
        while self._inflight < self._max:
            waiter = self._queue.pop(now, self._blocked())
            if waiter is None:
                return
            self._start(waiter.tenant)
            waiter.token.set()

    # -- rates -------------------------------------------------------------------------------
    def _bucket(self, tenant: Tenant, limit: str) -> TokenBucket | None:
        per_minute = tenant.limit(limit)
        if per_minute is None:
            return None
        key = (tenant.name, limit)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket.full(per_minute, self._clock())
        return bucket

    def _take(self, tenant: Tenant, limit: str, amount: int) -> None:
        bucket = self._bucket(tenant, limit)
        if bucket is None:
            return
        wait = bucket.take(amount, self._clock())
        if wait:
            raise RateLimited(tenant.name, limit, tenant.limit(limit) or 0, retry_after(wait))

    def _settle(self, tenant: Tenant, limit: str, reserved: int, used: int) -> None:
        bucket = self._bucket(tenant, limit)
        if bucket is not None:
            bucket.settle(reserved, used, self._clock())

    def _take_request(self, tenant: Tenant) -> None:
        self._take(tenant, "requests_per_minute", 1)

    def settle_requests(self, tenant: Tenant) -> None:
        self._settle(tenant, "requests_per_minute", 1, 0)

    def reserve_tokens(self, tenant: Tenant, amount: int) -> None:
        self._take(tenant, "tokens_per_minute", amount)

    def settle_tokens(self, tenant: Tenant, reserved: int, used: int) -> None:
        self._settle(tenant, "tokens_per_minute", reserved, used)
