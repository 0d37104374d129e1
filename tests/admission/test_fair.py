"""The fair gate on trio, without a server: who gets a freed place, what each refusal says,
and what a ticket settles. The buckets' clock is a list the test moves."""

from __future__ import annotations

from contextlib import AsyncExitStack
from functools import partial

import pytest
import trio
import trio.testing

from epd_trio._admission.fair import PLACES_HELD, FairAdmission
from epd_trio._core.errors import AtCapacity, RateLimited
from epd_trio._core.tenants import Tenant, TenantTable, parse_tenants

TENANTS = parse_tenants({
    "interactive": {"keys": ["sk-int"], "priority": 0},
    "batch": {"keys": ["sk-batch"], "priority": 1},
    "capped": {"max_inflight": 1},
    "rpm": {"requests_per_minute": 2},
    "tpm": {"tokens_per_minute": 600, "priority": 2},
})


def gate(max_inflight: int = 1, timeout: float = 30.0, aging: float = 0.0,
         now: list[float] | None = None, headroom: int = 0) -> FairAdmission:
    clock = now if now is not None else [0.0]
    return FairAdmission(max_inflight=max_inflight, timeout=timeout,
                         table=TenantTable(TENANTS), aging=aging,
                         tenant_header="x-tenant", clock=lambda: clock[0], headroom=headroom)


def tenant(admission: FairAdmission, name: str) -> Tenant:
    """Tenant ``name`` as a request reaches it: by its key when it has keys, else by name."""
    keys = next((t.keys for t in TENANTS if t.name == name), ())
    if keys:
        return admission.tenant_of([(b"authorization", f"Bearer {keys[0]}".encode())])
    return admission.tenant_of([(b"x-tenant", name.encode())])


def test_the_tenant_comes_from_the_key_else_the_header_else_default() -> None:
    admission = gate()
    assert admission.tenant_of([(b"authorization", b"Bearer sk-batch"),
                                (b"x-tenant", b"interactive")]).name == "batch"
    assert admission.tenant_of([(b"x-tenant", b"capped")]).name == "capped"
    # A tenant with keys is reached by them only (tests/core/test_tenants.py).
    assert admission.tenant_of([(b"x-tenant", b"interactive")]).name == "default"
    assert admission.tenant_of([(b"authorization", b"Bearer sk-nobody")]).name == "default"
    # The first authorization header is the one the key check reads: a second one naming no
    # key does not take the request out of its tenant (nor a second tenant header).
    assert admission.tenant_of([(b"authorization", b"Bearer sk-batch"),
                                (b"authorization", b"Bearer x")]).name == "batch"
    assert admission.tenant_of([(b"x-tenant", b"capped"), (b"x-tenant", b"rpm")]).name == "capped"


async def hold_a_place(admission: FairAdmission, admitted: list[tuple[str, trio.Event]],
                       name: str) -> None:
    """One request of tenant ``name``: admitted, it appends itself to ``admitted`` with the
    event that ends it, and holds its place until that is set."""
    async with AsyncExitStack() as resources:
        await admission.enter(tenant(admission, name), resources)
        done = trio.Event()
        admitted.append((name, done))
        await done.wait()


async def served_in_order(admission: FairAdmission, arrivals: list[str]) -> list[str]:
    """With the one place taken, ``arrivals`` queue in that order; then each admitted request
    finishes in turn. The order they were admitted in."""
    admitted: list[tuple[str, trio.Event]] = []
    request = partial(hold_a_place, admission, admitted)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "batch")
        await trio.testing.wait_all_tasks_blocked()
        for name in arrivals:
            nursery.start_soon(request, name)
            await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == 1 and sum(admission.depth().values()) == len(arrivals)
        for i in range(len(arrivals) + 1):
            assert len(admitted) == i + 1  # one place: one in flight at a time
            admitted[i][1].set()
            await trio.testing.wait_all_tasks_blocked()
    assert admission.inflight == 0
    return [name for name, _ in admitted[1:]]


async def test_a_freed_place_goes_to_the_better_band_first() -> None:
    order = await served_in_order(gate(), ["batch"] * 5 + ["interactive"])
    assert order == ["interactive"] + ["batch"] * 5


async def test_inside_a_band_tenants_take_turns() -> None:
    order = await served_in_order(gate(), ["interactive"] * 4 + ["default"] * 2)
    assert order == ["interactive", "default", "interactive", "default", "interactive",
                     "interactive"]


async def test_the_headroom_takes_a_better_band_at_once_and_the_worse_refills_under_the_cap(
) -> None:
    """Two places and one of headroom, both places batch's: an interactive request starts at
    once, a second one waits for the headroom; a batch one waits until the total is under
    the cap again, never in the headroom."""
    admission = gate(max_inflight=2, headroom=1)
    admitted: list[tuple[str, trio.Event]] = []
    request = partial(hold_a_place, admission, admitted)

    def running() -> list[str]:
        return sorted(name for name, done in admitted if not done.is_set())

    def finish(name: str) -> None:
        next(done for who, done in admitted if who == name and not done.is_set()).set()

    async with trio.open_nursery() as nursery:
        for name in ("batch", "batch", "interactive", "interactive", "batch"):
            nursery.start_soon(request, name)
            await trio.testing.wait_all_tasks_blocked()
        assert running() == ["batch", "batch", "interactive"] and admission.inflight == 3
        assert admission.depth() == {("interactive", 0): 1, ("batch", 1): 1}
        finish("batch")  # 2 in flight: the headroom, still outranking a batch in flight
        await trio.testing.wait_all_tasks_blocked()
        assert running() == ["batch", "interactive", "interactive"]
        finish("interactive")  # 2 in flight, at the cap: the batch waiter may not exceed it
        await trio.testing.wait_all_tasks_blocked()
        assert running() == ["batch", "interactive"] and admission.depth() == {("batch", 1): 1}
        finish("interactive")  # under the cap
        await trio.testing.wait_all_tasks_blocked()
        assert running() == ["batch", "batch"] and admission.depth() == {}
        for _ in range(2):
            finish("batch")
    assert admission.inflight == 0


async def test_the_headroom_is_not_for_a_band_no_better_than_every_one_in_flight() -> None:
    """One place, one of headroom: behind a batch request another batch one waits; behind an
    interactive one, so does another interactive one (nothing in flight to outrank)."""
    for holder, newcomer in (("batch", "batch"), ("interactive", "interactive"),
                             ("interactive", "batch")):
        admission = gate(max_inflight=1, headroom=1, timeout=0.05)
        async with AsyncExitStack() as held:
            await admission.enter(tenant(admission, holder), held)
            with pytest.raises(AtCapacity):
                await admission.enter(tenant(admission, newcomer), AsyncExitStack())
            assert admission.inflight == 1
    admission = gate(max_inflight=1, headroom=1, timeout=0.05)
    async with AsyncExitStack() as held:
        await admission.enter(tenant(admission, "tpm"), held)  # band 2
        await admission.enter(tenant(admission, "batch"), held)  # band 1: outranks it
        with pytest.raises(AtCapacity):  # the headroom is full
            await admission.enter(tenant(admission, "interactive"), AsyncExitStack())
        assert admission.inflight == 2


async def test_a_waiter_gets_a_503_with_retry_after_at_its_deadline() -> None:
    admission = gate(timeout=0.05)
    async with AsyncExitStack() as holder:
        await admission.enter(tenant(admission, "batch"), holder)
        async with AsyncExitStack() as resources:
            with pytest.raises(AtCapacity) as refused:
                await admission.enter(tenant(admission, "interactive"), resources)
    assert refused.value.status == 503 and refused.value.headers["retry-after"] == "1"
    assert "EPD_MAX_INFLIGHT" in refused.value.message
    assert admission.inflight == 0 and admission.depth() == {}


async def test_a_tenant_at_its_own_cap_gets_a_429_naming_max_inflight() -> None:
    admission = gate(max_inflight=10, timeout=0.05)
    async with AsyncExitStack() as holder:
        await admission.enter(tenant(admission, "capped"), holder)
        with pytest.raises(RateLimited) as refused:
            await admission.enter(tenant(admission, "capped"), AsyncExitStack())
        await admission.enter(tenant(admission, "default"), holder)  # others still pass
    payload = refused.value.payload()["error"]
    assert refused.value.status == 429 and payload["param"] == "max_inflight"
    assert payload["code"] == "rate_limit_exceeded"


async def test_requests_per_minute_refuse_with_retry_after_from_the_bucket() -> None:
    now = [0.0]
    admission = gate(max_inflight=10, now=now)
    body = {"model": "m"}
    async with AsyncExitStack() as resources:
        for _ in range(2):
            await (await admission.enter(tenant(admission, "rpm"), resources)).admitted(body)
        ticket = await admission.enter(tenant(admission, "rpm"), resources)
        with pytest.raises(RateLimited) as refused:
            await ticket.admitted(body)
        assert refused.value.payload()["error"]["param"] == "requests_per_minute"
        assert refused.value.headers["retry-after"] == "30"  # 2 a minute: one every 30 s
        now[0] = 30.0
        await ticket.admitted(body)


async def test_a_client_may_lower_its_priority_never_raise_it() -> None:
    admission = gate(max_inflight=10)
    async with AsyncExitStack() as resources:
        ticket = await admission.enter(tenant(admission, "batch"), resources)
        assert await ticket.admitted({"model": "m", "priority": -5}) == {"model": "m",
                                                                          "priority": 1}
        assert await ticket.admitted({"model": "m", "priority": 7}) == {"model": "m",
                                                                         "priority": 7}


async def test_tokens_are_reserved_then_settled_on_the_usage() -> None:
    now = [0.0]
    admission = gate(max_inflight=10, now=now)
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 290}  # 10 + 290 reserved
    async with AsyncExitStack() as first:
        ticket = await admission.enter(tenant(admission, "tpm"), first)
        await ticket.admitted(body)
        ticket.answered(b'{"usage": {"prompt_tokens": 12, "completion_tokens": 8}}')
        ticket2 = await admission.enter(tenant(admission, "tpm"), first)
        await ticket2.admitted(body)  # 600 - 300 - 300: empty
        with pytest.raises(RateLimited) as refused:
            await (await admission.enter(tenant(admission, "tpm"), first)).admitted(body)
        assert refused.value.payload()["error"]["param"] == "tokens_per_minute"
        assert refused.value.headers["retry-after"] == "30"  # 300 at 10 a second
        # The refused request gave back what it took: nothing of the bucket was spent on it.
    # Both settled: the first used 20 (its usage), the second 10 + 0 events (no answer).
    assert admission.bucket("tpm", "tokens_per_minute", 600).level == 600 - 20 - 10


async def test_a_stream_without_usage_settles_the_events_it_relayed() -> None:
    admission = gate(max_inflight=10)
    async with AsyncExitStack() as resources:
        ticket = await admission.enter(tenant(admission, "tpm"), resources)
        await ticket.admitted({"model": "m", "prompt": "x" * 40, "max_tokens": 100})
        ticket.relayed(b'data: {"a": 1}\n\ndata: {"a": 2}\n\n')
        ticket.relayed(b'data: {"a": 3}\n\ndata: [DONE]\n\n')
        ticket.answered(b'data: {"a": 3}\n\ndata: [DONE]\n\n')  # no usage in its tail
    assert admission.bucket("tpm", "tokens_per_minute", 600).level == 600 - 10 - 3


async def test_both_per_minute_limits_are_taken_together_or_not_at_all() -> None:
    """A request refused on its tokens takes no request unit, and the reverse."""
    table = TenantTable(parse_tenants({"both": {"requests_per_minute": 2,
                                                "tokens_per_minute": 100}}))
    admission = FairAdmission(max_inflight=10, timeout=1.0, table=table, aging=0.0,
                              clock=lambda: 0.0)
    both = table.by_name["both"]
    small, large = {"model": "m", "max_tokens": 10}, {"model": "m", "max_tokens": 1000}
    async with AsyncExitStack() as resources:
        await (await admission.enter(both, resources)).admitted(large)  # a full bucket: passes
        for _ in range(2):  # the tokens are in debt now: refused, no request unit taken
            with pytest.raises(RateLimited, match="tokens_per_minute"):
                await (await admission.enter(both, resources)).admitted(small)
        assert admission.bucket("both", "requests_per_minute", 2).level == 1


async def test_under_an_aged_flood_each_interactive_request_takes_the_next_freed_place() -> None:
    """The batch band has waited past the aging time (tied with interactive): each lone
    interactive request still gets the first place to free, not the second."""
    now = [0.0]
    admission = gate(max_inflight=2, aging=0.5, now=now)
    admitted: list[tuple[str, trio.Event]] = []
    request = partial(hold_a_place, admission, admitted)

    async def finish_one() -> str:
        """The oldest request in flight ends; who took its place."""
        running = [entry for entry in admitted if not entry[1].is_set()]
        before = len(admitted)
        running[0][1].set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(admitted) == before + 1
        return admitted[-1][0]

    async with trio.open_nursery() as nursery:
        for _ in range(12):
            nursery.start_soon(request, "batch")
        await trio.testing.wait_all_tasks_blocked()
        now[0] = 1.0  # batch's oldest waiter has aged two steps: level with band 0
        for _ in range(3):
            nursery.start_soon(request, "interactive")
            await trio.testing.wait_all_tasks_blocked()
            assert await finish_one() == "interactive"
            assert [await finish_one() for _ in range(2)] == ["batch", "batch"]
        nursery.cancel_scope.cancel()


class Store:
    """The shared store as fair admission sees it (``SharedBuckets`` and ``PlaceLeases``):
    whether it is up, and its answer to a take, set by the test."""

    def __init__(self, live_replicas: int = 1) -> None:
        self.up = True
        self.live_replicas = live_replicas
        self.answer: tuple[int, float] | None = (0, 0.0)
        self.asked: list[tuple[int, bytes] | None] = []
        self.given: list[bytes] = []
        self.fallbacks = 0
        #: A take that never answers (until cancelled).
        self.hang = False
        #: The store's answer to a settlement (False: gone), and the deltas it took.
        self.settles = True
        self.settled: list[int] = []

    def others_inflight(self, tenant: str) -> int:
        return 0

    def new_lease(self) -> bytes:
        return b"lease-%d" % len(self.asked)

    async def take(self, tenant: str, wants: object,
                   place: tuple[int, bytes] | None = None) -> tuple[int, float] | None:
        self.asked.append(place)
        if self.hang:
            await trio.sleep_forever()
        return self.answer

    def give(self, tenant: str, lease: bytes) -> None:
        self.given.append(lease)

    def settle(self, tenant: str, limit: str, per_minute: int, delta: int) -> bool:
        if self.settles:
            self.settled.append(delta)
        return self.settles

    def fell_back(self) -> None:
        self.fallbacks += 1


LEASED = TenantTable(parse_tenants({"six": {"max_inflight": 6}}))
SIX = LEASED.by_name["six"]


def leased_gate(store: Store, timeout: float = 30.0) -> FairAdmission:
    return FairAdmission(max_inflight=10, timeout=timeout, table=LEASED, aging=0.0,
                         clock=lambda: 0.0, shared=store, leases=store)


async def test_a_place_the_store_refuses_is_given_back_and_waited_for_again() -> None:
    """The store finds the tenant's places all held (the counts here lagged): the request gives
    this process's place back and waits; after the next read of the others' counts it asks
    again, takes the place, and gives its lease back when it ends."""
    store = Store()
    admission = leased_gate(store)
    store.answer = (PLACES_HELD, 6)
    done = trio.Event()

    async def request() -> None:
        async with AsyncExitStack() as resources:
            await (await admission.enter(SIX, resources)).admitted({"model": "m"})
            await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        assert store.asked == [(6, b"lease-0")] and store.given == [b"lease-0"]
        assert admission.inflight == 0 and admission.depth() == {("six", 0): 1}
        admission.dispatch()  # a release here: the tenant stays held until the next read
        await trio.testing.wait_all_tasks_blocked()
        assert len(store.asked) == 1
        store.answer = (0, 0.0)
        admission.refresh()
        await trio.testing.wait_all_tasks_blocked()
        assert store.asked[-1] == (6, b"lease-1") and admission.inflight == 1
        done.set()
    assert store.given == [b"lease-0", b"lease-1"] and admission.inflight == 0


async def test_a_request_the_store_keeps_refusing_gets_429_max_inflight_at_its_deadline(
) -> None:
    store = Store()
    store.answer = (PLACES_HELD, 6)
    admission = leased_gate(store, timeout=0.05)
    async with AsyncExitStack() as resources:
        ticket = await admission.enter(SIX, resources)
        with pytest.raises(RateLimited, match="max_inflight") as refused:
            await ticket.admitted({"model": "m"})
    assert refused.value.status == 429 and admission.inflight == 0


async def test_a_store_too_slow_to_answer_leaves_each_replica_its_share() -> None:
    """Up but slow (no answer in time), with 3 live replicas: 2 of the tenant's 6 places here,
    each decision counted; the third waits for the store."""
    store = Store(live_replicas=3)
    store.answer = None
    admission = leased_gate(store, timeout=0.05)
    async with AsyncExitStack() as resources:
        for _ in range(2):
            await (await admission.enter(SIX, resources)).admitted({"model": "m"})
        third = await admission.enter(SIX, resources)
        with pytest.raises(RateLimited, match="max_inflight"):
            await third.admitted({"model": "m"})
        assert admission.inflight == 2 and store.fallbacks == 3


async def test_with_the_store_gone_a_tenant_waits_past_its_share() -> None:
    """Gone: the share (6 / 3 = 2) holds before the body is read, as the whole cap would."""
    store = Store(live_replicas=3)
    store.up, store.answer = False, None
    admission = leased_gate(store, timeout=0.05)
    async with AsyncExitStack() as resources:
        for _ in range(2):
            await (await admission.enter(SIX, resources)).admitted({"model": "m"})
        with pytest.raises(RateLimited, match="max_inflight"):
            await admission.enter(SIX, resources)
        assert store.fallbacks == 2


async def test_a_request_cancelled_in_the_stores_round_trip_gives_its_lease_back() -> None:
    """The client left while the store was asked: the lease, held (and renewed) from the
    take on, is given back, else the tenant would lose that place at every replica."""
    store = Store()
    store.hang = True
    admission = leased_gate(store)
    async with trio.open_nursery() as nursery:

        async def request() -> None:
            async with AsyncExitStack() as resources:
                await (await admission.enter(SIX, resources)).admitted({"model": "m"})

        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        assert store.asked == [(6, b"lease-0")]
        nursery.cancel_scope.cancel()
    assert store.given == [b"lease-0"] and admission.inflight == 0


TPM = TenantTable(parse_tenants({"tpm": {"tokens_per_minute": 600}})).by_name["tpm"]


async def test_tokens_are_settled_in_the_bucket_that_reserved_them() -> None:
    """Reserved on this replica's share while the store was slow, settled there though the
    store answers again; reserved in the store, settled there, or (the store gone since) not
    at all: a bucket that was never charged is never credited."""
    store = Store(live_replicas=2)
    admission = FairAdmission(max_inflight=10, timeout=1.0, table=TenantTable((TPM,)),
                              aging=0.0, clock=lambda: 0.0, shared=store)
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 90}  # 10 + 90 reserved
    usage = b'{"usage": {"prompt_tokens": 10, "completion_tokens": 20}}'
    store.answer = None  # slow: this replica's share, 600 / 2
    async with AsyncExitStack() as resources:
        ticket = await admission.enter(TPM, resources)
        await ticket.admitted(body)
        ticket.answered(usage)
        store.answer = (0, 0.0)
    assert admission.bucket("tpm", "tokens_per_minute", 300).level == 300 - 30
    assert store.settled == []
    for settles in (True, False):
        store.settles = settles
        async with AsyncExitStack() as resources:
            ticket = await admission.enter(TPM, resources)
            await ticket.admitted(body)
            ticket.answered(usage)
    assert store.settled == [100 - 30]
    assert admission.bucket("tpm", "tokens_per_minute", 300).level == 300 - 30
    assert ("tpm", "tokens_per_minute", 600) not in admission._buckets
