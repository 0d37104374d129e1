"""The load signal of the load- and cache-aware policies: requests in flight per slot and stage.

What counts: the proxy's own in-flight requests per (stage, instance URL, DP rank), taken
**when the slot is chosen** and given back when that stage's work ends (a prefill when its
answer is read, a decode when its stream is over or the client left). Why at the choice and not
at the call: a decode slot is chosen before its request's prefill runs; counted only once the
decode call starts, every request deciding during that prefill would see the slot as idle (the
"load guard created too late" bug of SGLang #27547). Why per stage: a request's prefill load
must end with its prefill, not with its decode stream (SGLang #39951).

With ``epd-trio serve --workers N`` the counts live in shared memory (``SharedLoadTable``,
created by the runner beside the routing counters), so every worker routes on the load of all
of them. An optional scrape of each instance's ``/metrics`` (``_upstream/load_scraper``) adds what other
proxies and clients sent: a slot's load is ``max(own count, running + waiting)``, as vLLM's own
DP balancer combines its in-flight count with its engines' stats, so a stale scrape can raise a
load but never hide the proxy's own requests.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from ctypes import c_int64
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from .._core.engine_load import LoraState
from .._core.policies import SlotKey

#: Entries of the shared table: one per (stage, slot) ever seen; instances that leave keep
#: theirs (at 0). A roster of a few hundred instances with DP8 fits many times.
DEFAULT_TABLE_SLOTS = 16_384
#: The table's pseudo-stage holding the ``max_tokens`` in flight per decode slot (the size
#: tie-break of ``least_loaded``).
DECODE_TOKENS = "decode_tokens"


class LoadTable(Protocol):
    """In-flight counts per (stage, slot)."""

    def add(self, stage: str, key: SlotKey, n: int) -> None: ...

    def read(self, stage: str, keys: Sequence[SlotKey]) -> list[int]: ...


class LocalLoadTable:
    """The counts of one process (the default)."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[SlotKey, int]] = {}

    def add(self, stage: str, key: SlotKey, n: int) -> None:
        counts = self._counts.setdefault(stage, {})
        counts[key] = counts.get(key, 0) + n

    def read(self, stage: str, keys: Sequence[SlotKey]) -> list[int]:
        counts = self._counts.get(stage)
        if counts is None:
            return [0] * len(keys)
        get = counts.get
        return [get(key, 0) for key in keys]

    def snapshot(self) -> list[tuple[str, SlotKey, int]]:
        """Every count, for publishing to the other replicas (``_replicas/sync``)."""
        return [(stage, key, n) for stage, counts in self._counts.items()
                for key, n in counts.items()]


def _fingerprint(stage: str, key: SlotKey) -> int:
    """A stable, non-zero 63-bit identity of (stage, slot): the same in every worker process
    (Python's own ``hash`` is salted per process)."""
    raw = f"{stage}\n{key[0]}\n{key[1]}".encode()
    value = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
    return value or 1


class SharedLoadTable:
    """Counts in shared memory: an open-addressing table of (fingerprint, count) words.

    Entries are claimed once and never freed, so a worker may cache where each slot lives;
    a change is one add under a cross-process lock (a few microseconds); reads take no lock
    (a word read is atomic, and a load is an estimate anyway). A full table (more distinct
    slots than ``slots``, which takes a lot of registration churn) counts the newcomers in
    this process only, which degrades their balance across workers but never a request.
    """

    def __init__(self, context: BaseContext | None = None,
                 slots: int = DEFAULT_TABLE_SLOTS) -> None:
        ctx = context or multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        self._words = ctx.RawArray(c_int64, 2 * slots)
        self._slots = slots
        self._init_local()

    def _init_local(self) -> None:
        self._where: dict[tuple[str, SlotKey], int] = {}
        self._overflow = LocalLoadTable()

    def __getstate__(self) -> dict[str, Any]:
        return {"_lock": self._lock, "_words": self._words, "_slots": self._slots}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_local()

    def _locate(self, stage: str, key: SlotKey, claim: bool) -> int | None:
        where = self._where.get((stage, key))
        if where is not None:
            return where
        mark = _fingerprint(stage, key)
        words, slots = self._words, self._slots
        start = mark % slots
        with self._lock:
            for step in range(slots):
                index = (start + step) % slots
                found = words[2 * index]
                if found == mark or (found == 0 and claim):
                    words[2 * index] = mark
                    self._where[stage, key] = index
                    return index
                if found == 0:
                    return None
        return None

    def add(self, stage: str, key: SlotKey, n: int) -> None:
        index = self._locate(stage, key, claim=True)
        if index is None:
            self._overflow.add(stage, key, n)
            return
        with self._lock:
            self._words[2 * index + 1] += n

    def read(self, stage: str, keys: Sequence[SlotKey]) -> list[int]:
        words = self._words
        counts = []
        for key in keys:
            index = self._locate(stage, key, claim=False)
            counts.append(words[2 * index + 1] if index is not None
                          else self._overflow.read(stage, [key])[0])
        return counts


class Loads:
    """What the policies read: the in-flight table, plus the other replicas' counts, raised by
    the last ``/metrics`` scrape.

    ``remote`` maps (stage, slot) to the sum of the in-flight counts the other replicas last
    published (``EPD_STATE_URL``; empty otherwise), so a slot's load is every replica's
    requests: the others' as of their last publication, this one's live. ``scraped`` maps
    (stage, slot) to that slot's ``running + waiting`` as its instance last reported them.
    Their owners replace each whole (one assignment, so a decision never sees a half-written
    one).
    """

    def __init__(self, table: LoadTable | None = None) -> None:
        self.table: LoadTable = table if table is not None else LocalLoadTable()
        self.remote: Mapping[tuple[str, SlotKey], int] = {}
        self.scraped: Mapping[tuple[str, SlotKey], int] = {}
        #: Each scraped instance's LoRA adapters, running and queued, by URL (from the same
        #: scrape): which holder of an adapter to prefer.
        self.lora: Mapping[str, LoraState] = {}

    def read(self, stage: str, keys: Sequence[SlotKey]) -> list[int]:
        counts = self.table.read(stage, keys)
        remote = self.remote
        if remote:
            counts = [c + remote.get((stage, key), 0) for c, key in zip(counts, keys,
                                                                         strict=True)]
        scraped = self.scraped
        if scraped:
            counts = [max(c, scraped.get((stage, key), 0)) for c, key in zip(counts, keys,
                                                                              strict=True)]
        return counts

    def take(self, stage: str, key: SlotKey, n: int = 1) -> Callable[[], None]:
        """Count ``n`` in flight on ``key`` now; returns the (idempotent) release."""
        self.table.add(stage, key, n)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.table.add(stage, key, -n)

        return release

    @contextmanager
    def held(self, stage: str, key: SlotKey, n: int = 1) -> Iterator[None]:
        release = self.take(stage, key, n)
        try:
            yield
        finally:
            release()
