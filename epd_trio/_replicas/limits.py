"""The tenants' limits, shared by every replica through Redis: their per-minute buckets and
their places (``max_inflight``).

Why one script: a request's place, ``requests_per_minute`` and ``tokens_per_minute`` are taken
together, all or nothing, on Redis's own clock (``TIME``: replicas whose clocks disagree still
agree on a bucket's refill and on a lease's end), in one round trip on the state link's lean
connection (``cursor_link``), so an admission costs one round trip and a token none.
Settlement and giving a place back are sent without waiting for their reply (the request is
over; nobody waits for it).

Why ``EVALSHA``: the script goes by its SHA-1 (40 bytes), not its text (about 1,200), so Redis
neither reads nor hashes it on every admission. A Redis that does not know it (restarted, a
``SCRIPT FLUSH``, a promoted replica) answers ``NOSCRIPT``; the take is then sent again as
``EVAL``, which also caches the script: one round trip per admission, two on the first after
the cache was lost. A settlement's ``EVALSHA`` is not awaited, so a ``NOSCRIPT`` there loses
it; the ``EVAL`` of the take that meets ``NOSCRIPT`` also loads the settlement's script
(``SCRIPT LOAD``, not awaited). A lost settlement only keeps a reservation taken for up to a
minute (the bucket refills): on the side of the limit, never above it; after a restart without
persistence the bucket it was for is gone anyway.

Each bucket is a hash (``level``, ``updated``) that expires two minutes after its last use: a
bucket untouched for a minute is full again, and a missing one counts as full.

Places are leases, not a counter: a tenant's places are a sorted set of its requests in flight
at every replica, each scored by when its lease ends. A counter would leak whatever a dead
replica never gave back; a lease ends ``PLACE_LEASE`` seconds after its replica last renewed
it (every ``LEASE_RENEW`` seconds, and at every reconnect), so a dead replica's places come
back by themselves, and a store that restarted empty learns again what is in flight.

When the store does not answer in ``EPD_STATE_LIMITS_TIMEOUT`` (down, paused, a key of the
wrong type written by hand), ``take`` answers None and the caller enforces its share of each
limit (the limit divided by the replicas alive at the last look) on its own, counted in
``epd_trio_state_local_limits_total``: no request fails because Redis is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from .cursor_link import CommandRefused, LinkBroken

if TYPE_CHECKING:
    from .._observe.metrics import ProxyMetrics
    from .sync import StateLink

#: Milliseconds a bucket outlives its last use (one minute refills it whole), plus the time
#: its debt takes to repay: a missing bucket reads full, so an expiry before then would
#: forgive a tenant the debt of a request larger than its whole bucket.
BUCKET_EXPIRY_MS = 120_000
#: Seconds a request's place outlives its replica's last renewal: a replica that dies without
#: giving its places back (killed, cut off) holds them this long at most.
PLACE_LEASE = 10.0
#: Seconds between two renewals of the places a replica holds.
LEASE_RENEW = 2.0
LEASE_MS = str(int(PLACE_LEASE * 1000)).encode()

#: KEYS: the tenant's places (a sorted set: one member per request in flight at any replica,
#: scored by its lease's end in ms on Redis's clock), then the buckets. ARGV: the tenant's
#: ``max_inflight`` (-1: none, the places are not touched), this request's lease, the lease's
#: length (ms), the buckets' expiry (ms), then per bucket its per-minute limit and the amount
#: wanted. Returns {0, 0} when the place and every amount were taken; {-1, places held} when the
#: tenant holds all its places; else {index of the first bucket that does not fit (1-based),
#: milliseconds until it would}; nothing taken unless all is. A request wanting more than a
#: whole bucket needs it full (``_core/token_bucket.py``, the same rule).
#: Lua, in both scripts that write a bucket: its key's expiry from now, ``expiry`` ms plus
#: the time its debt (a level below 0) takes to repay at ``limit`` a minute.
_KEEP_BUCKET = """
local function keep_bucket(key, level, limit, expiry)
  redis.call('pexpire', key, tonumber(expiry) + math.ceil(math.max(0, -level) * 60000 / limit))
end
"""

_TAKE = _KEEP_BUCKET + """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cap = tonumber(ARGV[1])
if cap >= 0 then
  redis.call('zremrangebyscore', KEYS[1], '-inf', now * 1000)
  local held = redis.call('zcard', KEYS[1])
  if held >= cap then return {-1, held} end
end
local levels = {}
for i = 2, #KEYS do
  local limit = tonumber(ARGV[2 * i + 1])
  local amount = tonumber(ARGV[2 * i + 2])
  local h = redis.call('hmget', KEYS[i], 'level', 'updated')
  local level = tonumber(h[1]) or limit
  local updated = tonumber(h[2]) or now
  if now > updated then level = math.min(limit, level + (now - updated) * limit / 60) end
  levels[i] = level
  local need = math.min(amount, limit)
  if level < need then
    return {i - 1, math.ceil((need - level) * 60000 / limit)}
  end
end
for i = 2, #KEYS do
  local limit = tonumber(ARGV[2 * i + 1])
  local level = levels[i] - tonumber(ARGV[2 * i + 2])
  redis.call('hset', KEYS[i], 'level', string.format('%.17g', level),
             'updated', string.format('%.17g', now))
  keep_bucket(KEYS[i], level, limit, ARGV[4])
end
if cap >= 0 then
  redis.call('zadd', KEYS[1], now * 1000 + tonumber(ARGV[3]), ARGV[2])
  redis.call('pexpire', KEYS[1], ARGV[3])
end
return {0, 0}
"""

#: KEYS[1]: a tenant's places. ARGV: the lease's length (ms), then the leases this replica
#: holds: each (re)written to end one lease from now, so a store that lost them (restarted
#: empty, or gone while this replica decided on its share) counts them again.
_RENEW = """
local t = redis.call('time')
local ends = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('zadd', KEYS[1], ends, ARGV[i]) end
redis.call('pexpire', KEYS[1], ARGV[1])
return #ARGV - 1
"""

#: KEYS[1]: the bucket. ARGV: its per-minute limit, the amount given back (negative: taken),
#: the expiry.
_SETTLE = _KEEP_BUCKET + """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cap = tonumber(ARGV[1])
local h = redis.call('hmget', KEYS[1], 'level', 'updated')
local level = tonumber(h[1]) or cap
local updated = tonumber(h[2]) or now
if now > updated then level = math.min(cap, level + (now - updated) * cap / 60) end
level = math.min(cap, level + tonumber(ARGV[2]))
redis.call('hset', KEYS[1], 'level', string.format('%.17g', level),
           'updated', string.format('%.17g', now))
keep_bucket(KEYS[1], level, cap, ARGV[3])
return 0
"""


_TAKE_SHA = hashlib.sha1(_TAKE.encode()).hexdigest().encode()
_SETTLE_SHA = hashlib.sha1(_SETTLE.encode()).hexdigest().encode()


def _unknown_script(refused: CommandRefused) -> bool:
    return "NOSCRIPT" in str(refused)


class SharedLimits:
    """``_admission.fair.SharedBuckets`` and ``PlaceLeases`` on the state link of one replica;
    an admission waits ``timeout`` seconds for the store (``EPD_STATE_LIMITS_TIMEOUT``), then
    decides on the replica's share."""

    def __init__(self, link: StateLink, metrics: ProxyMetrics, *, timeout: float) -> None:
        self._link = link
        self._metrics = metrics
        self._timeout = timeout
        self._prefix = link.keys.prefix + "limit:"
        #: The leases this replica holds, per tenant: renewed every ``LEASE_RENEW`` seconds
        #: and at every reconnect (``keep_places``), given back when their request ends.
        self._held: dict[str, set[bytes]] = {}
        #: Leases are unique per process, even under a replica id two processes share.
        self._lease_mark = f"{link.replica_id}:{secrets.token_hex(4)}:".encode()
        self._leases = itertools.count()

    @property
    def up(self) -> bool:
        return self._link.limits_link is not None

    @property
    def live_replicas(self) -> int:
        return self._link.live_replicas

    def others_inflight(self, tenant: str) -> int:
        return self._link.others_inflight(tenant)

    def _key(self, tenant: str, limit: str) -> bytes:
        return f"{self._prefix}{tenant}:{limit}".encode()

    def new_lease(self) -> bytes:
        return self._lease_mark + str(next(self._leases)).encode()

    async def take(self, tenant: str, wants: Sequence[tuple[str, int, int]],
                   place: tuple[int, bytes] | None = None) -> tuple[int, float] | None:
        if place is not None:
            # Held from now on, whatever the answer: if it never comes, the caller decides on
            # its share and the place is its; a refusal is given back (``give``).
            self._held.setdefault(tenant, set()).add(place[1])
        lean = self._link.limits_link
        if lean is None:
            return None
        cap, lease = (b"-1", b"") if place is None else (str(place[0]).encode(), place[1])
        args: list[bytes] = [cap, lease, LEASE_MS, str(BUCKET_EXPIRY_MS).encode()]
        for _, per_minute, amount in wants:
            args += [str(per_minute).encode(), str(amount).encode()]
        keys = [self._key(tenant, "max_inflight"),
                *(self._key(tenant, limit) for limit, _, _ in wants)]
        # A reply that comes after the timeout is dropped, though Redis took the amounts: the
        # request is then counted twice (there, and in the local share): a slow store errs on
        # the side of the limit, never above it.
        tail = (str(len(keys)).encode(), *keys, *args)
        with trio.move_on_after(self._timeout):
            try:
                try:
                    reply = await lean.call(b"EVALSHA", _TAKE_SHA, *tail)
                except CommandRefused as refused:
                    if not _unknown_script(refused):
                        raise
                    lean.send(b"SCRIPT", b"LOAD", _SETTLE.encode())
                    reply = await lean.call(b"EVAL", _TAKE.encode(), *tail)
            except (LinkBroken, CommandRefused):
                return None
            if isinstance(reply, list) and len(reply) == 2:
                return reply[0], reply[1] / 1000
        return None

    def give(self, tenant: str, lease: bytes) -> None:
        held = self._held.get(tenant)
        if held is not None:
            held.discard(lease)
            if not held:
                del self._held[tenant]
        lean = self._link.limits_link
        if lean is not None:
            with contextlib.suppress(LinkBroken):  # else the lease ends by itself
                lean.send(b"ZREM", self._key(tenant, "max_inflight"), lease)

    def settle(self, tenant: str, limit: str, per_minute: int, delta: int) -> bool:
        lean = self._link.limits_link
        if lean is None:
            return False
        try:
            lean.send(b"EVALSHA", _SETTLE_SHA, b"1", self._key(tenant, limit),
                      str(per_minute).encode(), str(delta).encode(),
                      str(BUCKET_EXPIRY_MS).encode())
        except LinkBroken:
            return False
        return True

    def fell_back(self) -> None:
        self._metrics.state_local_limit()

    async def keep_places(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
        """Renew this replica's leases every ``LEASE_RENEW`` seconds, and at once when the
        link comes (back) up: a replica that dies loses its places ``PLACE_LEASE`` seconds
        later, and one that lived through an outage gives the store back what it holds. One
        task per replica, in the proxy's task nursery; one script per capped tenant with
        requests in flight, unawaited."""
        task_status.started()
        while True:
            with trio.move_on_after(LEASE_RENEW):
                await self._link.next_change()
            lean = self._link.limits_link
            if lean is None:
                continue
            for tenant, leases in self._held.items():
                try:
                    lean.send(b"EVAL", _RENEW.encode(), b"1", self._key(tenant, "max_inflight"),
                              LEASE_MS, *leases)
                except LinkBroken:
                    break
