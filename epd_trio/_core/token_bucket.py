"""A token bucket holding one minute's worth of a per-minute limit.

Why a bucket: a burst up to the limit passes at once (a client that was quiet may catch up),
then it refills steadily at ``limit / 60`` per second, so a minute never passes more than
about twice the limit and an hour never more than sixty times it.

Reservations: a request takes its estimate up front and ``settle`` gives back what it did not
use (or takes the excess: the level may go below zero, a debt the refill pays before anyone
else passes). A request asking for more than the whole bucket passes only when the bucket is
full, and leaves it in debt; otherwise it could never pass at all.

Time comes in as ``now`` (seconds on any monotonic clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_MINUTE = 60.0


@dataclass(slots=True)
class TokenBucket:
    """One limit of one tenant: ``capacity`` per minute, ``level`` left at ``updated``."""

    capacity: float
    level: float
    updated: float

    @classmethod
    def full(cls, per_minute: float, now: float) -> TokenBucket:
        return cls(capacity=per_minute, level=per_minute, updated=now)

    @property
    def rate(self) -> float:
        """Units refilled per second."""
        return self.capacity / SECONDS_PER_MINUTE

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` could be taken (0: now)."""
        self.refill(now)
        missing = min(amount, self.capacity) - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if it is there: 0.0; else nothing is taken, and the seconds until
        it would be."""
        wait = self.wait_for(amount, now)
        if wait == 0.0:
            self.level -= amount
        return wait

    def settle(self, reserved: float, used: float, now: float) -> None:
        """A request that reserved ``reserved`` used ``used``: the difference goes back (or is
        taken)."""
        self.refill(now)
        self.level = min(self.capacity, self.level + reserved - used)


def retry_after(seconds: float) -> int:
    """``Retry-After`` in whole seconds, at least 1 (the header takes no fractions)."""
    return max(1, math.ceil(seconds))
