"""The tenants' per-minute buckets in shared memory, for the workers of ``epd-trio serve``.

Why: with ``--workers N`` and no ``EPD_STATE_URL``, each worker is its own process, and a
tenant's ``requests_per_minute`` kept per process would grant it N times its limit. The runner
creates this table with the rest of the shared routing state (``roster_store``), before
spawning the workers; a worker's fair gate takes from it (``_admission/fair.SharedBuckets``).

How: an open-addressing table of buckets, each found by a fingerprint of (tenant, limit) that
is the same in every process, holding its level and the time it was last updated, on
``time.monotonic()`` (one clock for every process of the machine). A take or a settlement is
the pure bucket arithmetic (``_core/token_bucket``) on those words, under one cross-process
lock: a few microseconds. A full table (more tenants than ``slots`` / 2) answers None for the
newcomers, whose limits are then kept in their worker only.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from collections.abc import Sequence
from ctypes import c_double, c_int64
from multiprocessing.context import BaseContext
from typing import Any

from .._core.token_bucket import TokenBucket

#: Buckets the table holds (two per tenant with both per-minute limits).
DEFAULT_BUCKETS = 512


def _fingerprint(tenant: str, limit: str) -> int:
    raw = f"{tenant}\n{limit}".encode()
    return (int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1) or 1


class SharedRateBuckets:
    """Buckets in shared memory; pickled into each spawned worker."""

    def __init__(self, context: BaseContext | None = None, slots: int = DEFAULT_BUCKETS) -> None:
        ctx = context or multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        self._marks = ctx.RawArray(c_int64, slots)
        #: Per slot: level, updated.
        self._values = ctx.RawArray(c_double, 2 * slots)
        self._slots = slots
        self._init_local()

    def _init_local(self) -> None:
        self._where: dict[tuple[str, str], int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_lock": self._lock, "_marks": self._marks, "_values": self._values,
                "_slots": self._slots}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_local()

    #: Always 1: the workers share one table, whole (``_admission/fair.SharedBuckets``).
    live_replicas = 1

    def others_inflight(self, tenant: str) -> int:
        """Not shared between workers (a place is a process's own): 0."""
        return 0

    def _locate(self, tenant: str, limit: str, per_minute: float) -> int | None:
        """The bucket's slot (claimed full when new; call under the lock), None: table full."""
        where = self._where.get((tenant, limit))
        if where is not None:
            return where
        mark = _fingerprint(tenant, limit)
        marks, slots = self._marks, self._slots
        start = mark % slots
        for step in range(slots):
            index = (start + step) % slots
            found = marks[index]
            if found == 0:
                marks[index] = mark
                self._values[2 * index] = per_minute
                self._values[2 * index + 1] = time.monotonic()
            if found in (0, mark):
                self._where[tenant, limit] = index
                return index
        return None

    def _bucket(self, index: int, per_minute: float) -> TokenBucket:
        values = self._values
        return TokenBucket(capacity=per_minute, level=values[2 * index],
                           updated=values[2 * index + 1])

    def _store(self, index: int, bucket: TokenBucket) -> None:
        self._values[2 * index] = bucket.level
        self._values[2 * index + 1] = bucket.updated

    async def take(self, tenant: str, wants: Sequence[tuple[str, int, int]],
                   place: tuple[int, bytes] | None = None) -> tuple[int, float] | None:
        """``place`` is never given: the workers' places are ``_state/tenant_places``."""
        assert place is None
        now = time.monotonic()
        with self._lock:
            slots = [self._locate(tenant, limit, per_minute) for limit, per_minute, _ in wants]
            if None in slots:
                return None
            buckets = [self._bucket(index, per_minute)
                       for index, (_, per_minute, _) in zip(slots, wants, strict=True)
                       if index is not None]
            for n, (bucket, (_, _, amount)) in enumerate(zip(buckets, wants, strict=True)):
                wait = bucket.wait_for(amount, now)
                if wait:
                    return n + 1, wait
            for index, bucket, (_, _, amount) in zip(slots, buckets, wants, strict=True):
                bucket.take(amount, now)
                assert index is not None
                self._store(index, bucket)
        return 0, 0.0

    def settle(self, tenant: str, limit: str, per_minute: int, delta: int) -> bool:
        now = time.monotonic()
        with self._lock:
            index = self._locate(tenant, limit, per_minute)
            if index is None:
                return False
            bucket = self._bucket(index, per_minute)
            bucket.settle(delta, 0, now)
            self._store(index, bucket)
        return True

    def fell_back(self) -> None:
        """A full table: the newcomer's limits are its worker's own (nothing to count)."""
