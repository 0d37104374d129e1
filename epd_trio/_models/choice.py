"""An alias's target: exact weighted turns, or a weighted hash of the client's session key.

Without a session key, targets take turns in proportion to their weights, as nginx's smooth
weighted round-robin spreads them: 90/10 gives exactly 9 of every 10 requests to the first,
interleaved rather than in runs, so a canary's share is exact from the first requests on (a
random draw is off by its variance: about ±1 point at a thousand requests for a 10 % canary).

With a session key (``EPD_ALIAS_STICKY_HEADER``), the target is the one with the highest
weighted rendezvous score for that key: ``-weight / ln(u)``, ``u`` a uniform draw hashed from
the key and the target's name. Each key always gets the same target while the weights stand
(a conversation does not flip between versions); a target's share of the keys is its share of
the weight; raising one target's weight moves keys only to it, and only as many as its new
share needs; and a target that cannot serve is skipped, its keys spread over the others by
the same scores, and they come back when it does. Nothing is stored per key: every replica
and worker agrees without sharing anything.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence


class WeightedTurns:
    """Smooth weighted round-robin over fixed weights (one per target); ``next`` picks among
    the targets ``eligible`` says may serve now."""

    __slots__ = ("_current", "_weights")

    def __init__(self, weights: Sequence[float]) -> None:
        if not weights or any(w <= 0 for w in weights):
            raise ValueError("weights must be positive")
        self._weights = tuple(weights)
        self._current = [0.0] * len(weights)

    def next(self, eligible: Sequence[bool] | None = None) -> int | None:
        """The next target's index; None when no target is eligible."""
        total, best = 0.0, None
        current, weights = self._current, self._weights
        for i, weight in enumerate(weights):
            if eligible is not None and not eligible[i]:
                continue
            current[i] += weight
            total += weight
            if best is None or current[i] > current[best]:
                best = i
        if best is not None:
            current[best] -= total
        return best


def sticky_choice(key: str, names: Sequence[str], weights: Sequence[float],
                  eligible: Sequence[bool] | None = None) -> int | None:
    """The target ``key`` sticks to (weighted rendezvous hashing, see the module); None when
    no target is eligible."""
    best, best_score = None, -math.inf
    raw = key.encode("utf-8", "surrogatepass")
    for i, (name, weight) in enumerate(zip(names, weights, strict=True)):
        if eligible is not None and not eligible[i]:
            continue
        digest = hashlib.blake2b(raw + b"\x00" + name.encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2.0**64  # in (0, 1), never 0 or 1
        score = -weight / math.log(u)
        if score > best_score:
            best, best_score = i, score
    return best
