"""The tenants' requests in flight in shared memory, for the workers of ``epd-trio serve``.

Why: with ``--workers N`` and no ``EPD_STATE_URL``, each worker is its own process, and a
tenant's ``max_inflight`` counted per process would let it hold N times its cap. The runner
creates this table with the rest of the shared routing state (``roster_store``), before
spawning the workers; a worker's fair gate takes a tenant's place here
(``_admission/fair.SharedPlaces``).

How: an open-addressing table of counts, each found by a fingerprint of the tenant's name
that is the same in every process (as ``loads`` and ``rate_buckets`` find theirs). A take is
take-if-below-the-cap under one cross-process lock, so two workers can never both take the
last place; a read is one unlocked word read (an estimate, as a load is). Only tenants with a
``max_inflight`` are counted here. A full table (more capped tenants than ``slots``) counts
the newcomers in their worker only, which then holds them per process, never a request.

Nothing here wakes a waiter in another worker: the fair gate re-checks the shared counts on
a short period (``_admission/fair.WORKERS_RECHECK``) while anyone waits.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from ctypes import c_int64
from multiprocessing.context import BaseContext
from typing import Any

#: Tenants the table holds (only those with a ``max_inflight``).
DEFAULT_TENANTS = 512


def _fingerprint(tenant: str) -> int:
    raw = tenant.encode()
    return (int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1) or 1


class SharedTenantPlaces:
    """Per-tenant counts in shared memory; pickled into each spawned worker."""

    def __init__(self, context: BaseContext | None = None, slots: int = DEFAULT_TENANTS) -> None:
        ctx = context or multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        #: Per slot: the tenant's fingerprint, its requests in flight in every worker.
        self._words = ctx.RawArray(c_int64, 2 * slots)
        self._slots = slots
        self._init_local()

    def _init_local(self) -> None:
        self._where: dict[str, int] = {}
        #: The counts of the tenants the full table has no room for (this worker's only).
        self._overflow: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_lock": self._lock, "_words": self._words, "_slots": self._slots}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_local()

    def _locate(self, tenant: str) -> int | None:
        """The tenant's slot (claimed when new; call under the lock); None: table full."""
        where = self._where.get(tenant)
        if where is not None:
            return where
        mark = _fingerprint(tenant)
        words, slots = self._words, self._slots
        start = mark % slots
        for step in range(slots):
            index = (start + step) % slots
            found = words[2 * index]
            if found == 0:
                words[2 * index] = mark
            if found in (0, mark):
                self._where[tenant] = index
                return index
        return None

    def count(self, tenant: str) -> int:
        """The tenant's requests in flight in every worker (no lock: a word read)."""
        index = self._where.get(tenant)
        if index is None:
            with self._lock:
                index = self._locate(tenant)
            if index is None:
                return self._overflow.get(tenant, 0)
        return self._words[2 * index + 1]

    def take(self, tenant: str, cap: int) -> bool:
        """One place of the tenant's ``cap``, if fewer than ``cap`` are in flight (atomic)."""
        with self._lock:
            index = self._locate(tenant)
            if index is not None:
                held = self._words[2 * index + 1]
                if held >= cap:
                    return False
                self._words[2 * index + 1] = held + 1
                return True
        held = self._overflow.get(tenant, 0)
        if held >= cap:
            return False
        self._overflow[tenant] = held + 1
        return True

    def give(self, tenant: str) -> None:
        """A place taken by ``take`` is free again."""
        with self._lock:
            index = self._locate(tenant)
            if index is not None:
                self._words[2 * index + 1] -= 1
                return
        self._overflow[tenant] -= 1
