"""The admission queue's rules, table by table: bands, aging, weighted turns, skipping."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_trio._core.fair_queue import FairQueue, Waiter


def waiter(tenant: str, priority: int = 0, weight: float = 1.0, at: float = 0.0) -> Waiter:
    return Waiter(tenant=tenant, priority=priority, weight=weight, enqueued=at)


def served(queue: FairQueue, n: int, now: float = 0.0, blocked: tuple[str, ...] = ()) -> list[str]:
    out = []
    for _ in range(n):
        w = queue.pop(now, blocked)
        out.append("-" if w is None else w.tenant)
    return out


def test_the_lower_priority_number_always_goes_first_without_aging() -> None:
    q = FairQueue(aging=0)
    for _ in range(3):
        q.push(waiter("batch", priority=1))
    q.push(waiter("interactive", priority=0, at=5.0))
    assert served(q, 5, now=100.0) == ["interactive", "batch", "batch", "batch", "-"]
    assert len(q) == 0


def test_one_tenants_thousand_waiters_do_not_starve_anothers_one() -> None:
    q = FairQueue(aging=0)
    for _ in range(1000):
        q.push(waiter("flood"))
    q.push(waiter("one"))
    assert "one" in served(q, 2)


def test_tenants_are_served_in_proportion_to_their_weights() -> None:
    q = FairQueue(aging=0)
    for _ in range(400):
        q.push(waiter("heavy", weight=3))
        q.push(waiter("light", weight=1))
    counts = Counter(served(q, 200))
    assert counts == {"heavy": 150, "light": 50}


def test_fractional_weights_take_turns_too() -> None:
    q = FairQueue(aging=0)
    for _ in range(100):
        q.push(waiter("a", weight=0.5))
        q.push(waiter("b", weight=0.25))
    assert Counter(served(q, 30)) == {"a": 20, "b": 10}


def test_an_aged_band_takes_turns_with_the_best_one_never_overtakes_it() -> None:
    q = FairQueue(aging=0.5)
    for _ in range(4):
        q.push(waiter("batch", priority=2, at=0.0))
        q.push(waiter("interactive", priority=0, at=0.9))
    # At 0.9 s batch is one step up (1): still behind band 0.
    assert served(q, 1, now=0.9) == ["interactive"]
    # At 1.0 s it is two steps up: level with band 0 (never above it), and they take turns,
    # batch first: interactive had the last place.
    assert served(q, 6, now=1.0) == ["batch", "interactive", "batch", "interactive",
                                     "batch", "interactive"]
    assert served(q, 2, now=1.0) == ["batch", "-"]


def test_a_band_that_comes_back_after_the_aged_band_took_the_last_places_goes_first() -> None:
    q = FairQueue(aging=0.5)
    for _ in range(20):
        q.push(waiter("batch", priority=1, at=0.0))
    for _ in range(3):  # one interactive request at a time, as a steady trickle sends them
        q.push(waiter("interactive", priority=0, at=1.0))
        assert served(q, 1, now=1.0) == ["interactive"]
        assert served(q, 3, now=1.0) == ["batch"] * 3


def test_a_band_that_empties_after_each_place_still_takes_turns() -> None:
    q = FairQueue(aging=0.5)
    for _ in range(20):
        q.push(waiter("batch", priority=1, at=0.0))
    order = []
    for _ in range(6):  # a new interactive request always waiting when a place frees
        if ("interactive", 0) not in q.depth():
            q.push(waiter("interactive", priority=0, at=1.0))
        order += served(q, 1, now=1.0)
    assert order == ["interactive", "batch"] * 3


def test_a_requeued_waiter_keeps_its_bands_turn() -> None:
    q = FairQueue(aging=0.5)
    for _ in range(5):
        q.push(waiter("batch", priority=1, at=0.0))
    assert served(q, 1, now=1.0) == ["batch"]
    q.push(waiter("interactive", priority=0, at=1.0))
    given = q.pop(1.0)
    assert given is not None and given.tenant == "interactive"
    q.requeue(given)  # it could not start: its band has still not had a place since batch's
    assert served(q, 2, now=1.0) == ["interactive", "batch"]


def test_without_aging_a_lower_band_waits_for_ever() -> None:
    q = FairQueue(aging=0)
    q.push(waiter("batch", priority=1, at=0.0))
    for _ in range(3):
        q.push(waiter("interactive", priority=0, at=1000.0))
    assert served(q, 4, now=2000.0) == ["interactive"] * 3 + ["batch"]


def test_a_blocked_tenant_is_skipped_so_no_place_stays_idle() -> None:
    q = FairQueue(aging=0)
    q.push(waiter("capped", priority=0))
    q.push(waiter("other", priority=5))
    assert served(q, 1, blocked=("capped",)) == ["other"]
    assert served(q, 1, blocked=("capped",)) == ["-"]  # only the blocked one waits
    assert served(q, 1) == ["capped"]


def test_cancelled_waiters_are_dropped_and_not_counted() -> None:
    q = FairQueue(aging=0)
    gone = waiter("a")
    q.push(gone)
    q.push(waiter("a"))
    q.push(waiter("b"))
    gone.cancelled = True
    assert q.depth() == {("a", 0): 1, ("b", 0): 1}
    assert sorted(served(q, 3)) == ["-", "a", "b"]
    assert len(q) == 0 and q.depth() == {}


def test_a_tenant_that_leaves_and_returns_starts_without_old_credit() -> None:
    q = FairQueue(aging=0)
    q.push(waiter("a", weight=5))
    assert served(q, 1) == ["a"]
    q.push(waiter("b"))
    q.push(waiter("a", weight=5))
    q.push(waiter("b"))
    # b was first in the now-empty band: its turn starts at once; a's credit did not carry.
    assert served(q, 3) == ["b", "a", "b"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "cancel", "lose"]),
                          st.sampled_from(["a", "b", "c"]), st.integers(0, 2), st.booleans()),
                max_size=80),
       st.sampled_from([0.0, 0.5]))
def test_the_queue_never_loses_serves_twice_or_serves_the_blocked(
    steps: list[tuple[str, str, int, bool]], aging: float,
) -> None:
    q = FairQueue(aging=aging)
    live: list[Waiter] = []
    served_ids: set[int] = set()
    now = 0.0
    for n, (op, tenant, index, block) in enumerate(steps):
        now += 0.1
        if op == "push":  # a tenant's priority and weight are its table's: fixed per tenant
            w = waiter(tenant, priority={"a": 0, "b": 1, "c": 2}[tenant],
                       weight={"a": 1.0, "b": 3.0, "c": 0.5}[tenant], at=now)
            w.token = n  # its identity
            q.push(w)
            live.append(w)
        elif op == "cancel" and live:
            live.pop(index % len(live)).cancelled = True
        elif op in ("pop", "lose"):  # lose: popped, then its place taken by another process
            blocked = (tenant,) if block else ()
            w = q.pop(now, blocked)
            if w is None:
                assert all(x.tenant in blocked for x in live)
            else:
                assert w in live and w.tenant not in blocked and w.token not in served_ids
                if op == "lose":
                    q.requeue(w)
                    continue
                served_ids.add(w.token)
                live.remove(w)
    drained = []
    while (w := q.pop(now + 100.0)) is not None:
        drained.append(w)
    assert sorted(w.token for w in drained) == sorted(w.token for w in live) and len(q) == 0


def test_a_requeued_waiter_goes_back_to_the_head_of_its_line_with_its_credit() -> None:
    q = FairQueue(aging=0)
    first, second = waiter("a"), waiter("a")
    q.push(first)
    q.push(second)
    q.push(waiter("b"))
    popped = q.pop(0.0)
    assert popped is first
    q.requeue(first)  # another worker took a's last place: a is blocked now
    assert served(q, 1, blocked=("a",)) == ["b"]
    assert q.pop(0.0) is first and q.pop(0.0) is second and len(q) == 0


def test_a_requeued_last_waiter_rejoins_its_band() -> None:
    q = FairQueue(aging=0)
    only = waiter("a")
    q.push(only)
    assert q.pop(0.0) is only and len(q) == 0
    q.requeue(only)
    assert len(q) == 1 and q.pop(0.0) is only
