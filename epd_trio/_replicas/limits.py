"""The tenants' per-minute buckets, shared by every replica through Redis.

Why one script: a request's ``requests_per_minute`` and ``tokens_per_minute`` are taken
together, all or nothing, on Redis's own clock (``TIME``: replicas whose clocks disagree still
agree on a bucket's refill), in one round trip on the state link's lean connection
(``cursor_link``), so an admission costs one round trip at most and a token none. Settlement
is sent without waiting for its reply (the request is over; nobody waits for it).

Each bucket is a hash (``level``, ``updated``) that expires two minutes after its last use: a
bucket untouched for a minute is full again, and a missing one counts as full.

When the store does not answer in ``LIMITS_TIMEOUT`` (down, paused, a key of the wrong type
written by hand), ``take`` answers None and the caller enforces its share of the limit (the
limit divided by the replicas alive at the last look) on its own, counted in
``epd_trio_state_local_limits_total``: no request fails because Redis is gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from .cursor_link import CommandRefused, LinkBroken

if TYPE_CHECKING:
    from .._observe.metrics import ProxyMetrics
    from .sync import StateLink

#: Seconds an admission waits for the store before it decides on the local share. Short: it
#: is on the request's path, and the local share is a fine answer.
LIMITS_TIMEOUT = 0.1
#: Milliseconds a bucket outlives its last use (one minute refills it whole).
BUCKET_EXPIRY_MS = 120_000

#: KEYS: the buckets. ARGV: per bucket, its per-minute limit and the amount wanted. Returns
#: {0, 0} when every amount was taken, else {index of the first that does not fit (1-based),
#: milliseconds until it would}, nothing taken. A request wanting more than a whole bucket
#: needs it full (``_core/token_bucket.py``, the same rule).
_TAKE = """
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local levels = {}
for i = 1, #KEYS do
  local cap = tonumber(ARGV[2 * i - 1])
  local amount = tonumber(ARGV[2 * i])
  local h = redis.call('hmget', KEYS[i], 'level', 'updated')
  local level = tonumber(h[1]) or cap
  local updated = tonumber(h[2]) or now
  if now > updated then level = math.min(cap, level + (now - updated) * cap / 60) end
  levels[i] = level
  local need = math.min(amount, cap)
  if level < need then
    return {i, math.ceil((need - level) * 60000 / cap)}
  end
end
for i = 1, #KEYS do
  redis.call('hset', KEYS[i], 'level', string.format('%.17g', levels[i] - tonumber(ARGV[2 * i])),
             'updated', string.format('%.17g', now))
  redis.call('pexpire', KEYS[i], ARGV[#ARGV])
end
return {0, 0}
"""

#: KEYS[1]: the bucket. ARGV: its per-minute limit, the amount given back (negative: taken),
#: the expiry.
_SETTLE = """
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
redis.call('pexpire', KEYS[1], ARGV[3])
return 0
"""


class SharedLimits:
    """``_admission.fair.SharedBuckets`` on the state link of one replica."""

    def __init__(self, link: StateLink, metrics: ProxyMetrics) -> None:
        self._link = link
        self._metrics = metrics
        self._prefix = link.keys.prefix + "limit:"

    @property
    def live_replicas(self) -> int:
        return self._link.live_replicas

    def others_inflight(self, tenant: str) -> int:
        return self._link.others_inflight(tenant)

    def _key(self, tenant: str, limit: str) -> bytes:
        return f"{self._prefix}{tenant}:{limit}".encode()

    async def take(self, tenant: str, wants: Sequence[tuple[str, int, int]]
                   ) -> tuple[int, float] | None:
        lean = self._link.limits_link
        if lean is None:
            return None
        args: list[bytes] = []
        for _, per_minute, amount in wants:
            args += [str(per_minute).encode(), str(amount).encode()]
        keys = [self._key(tenant, limit) for limit, _, _ in wants]
        # A reply that comes after the timeout is dropped, though Redis took the amounts: the
        # request is then counted twice (there, and in the local share): a slow store errs on
        # the side of the limit, never above it.
        with trio.move_on_after(LIMITS_TIMEOUT):
            try:
                reply = await lean.call(b"EVAL", _TAKE.encode(), str(len(keys)).encode(), *keys,
                                        *args, str(BUCKET_EXPIRY_MS).encode())
            except (LinkBroken, CommandRefused):
                return None
            if isinstance(reply, list) and len(reply) == 2:
                return reply[0], reply[1] / 1000
        return None

    def settle(self, tenant: str, limit: str, per_minute: int, delta: int) -> bool:
        lean = self._link.limits_link
        if lean is None:
            return False
        try:
            lean.send(b"EVAL", _SETTLE.encode(), b"1", self._key(tenant, limit),
                      str(per_minute).encode(), str(delta).encode(),
                      str(BUCKET_EXPIRY_MS).encode())
        except LinkBroken:
            return False
        return True

    def fell_back(self) -> None:
        self._metrics.state_local_limit()
