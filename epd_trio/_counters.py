"""Routing counters: in-process, or shared by the worker processes of one ``epd-trio serve``.

Why shared memory: with ``--workers N`` each process has its own cursors; if each starts at 0,
the first requests of every worker all go to encoder 0 and slot 0 (the upstream bug again, across
processes), and short bursts, where the kernel hands a few connections to each worker, stay
skewed. One counter in shared memory, advanced under one cross-process lock, gives every worker
the next position of a single global sequence: the distribution is exactly round-robin whatever
the accept pattern. The critical section is an add on one machine word (microseconds, never a
blocking wait in practice), so taking a ``multiprocessing`` lock inside the event loop is fine.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext
from multiprocessing.sharedctypes import Synchronized
from typing import Protocol


class Counter(Protocol):
    """A monotonic position: ``fetch_add(n)`` returns the old value and adds ``n``."""

    def fetch_add(self, n: int) -> int: ...


class LocalCounter:
    """A counter owned by one process (the default)."""

    def __init__(self, start: int = 0) -> None:
        self._value = start

    def fetch_add(self, n: int) -> int:
        old = self._value
        self._value = old + n
        return old


class SharedCounter:
    """A counter in shared memory, created by the parent before the workers are spawned."""

    def __init__(self, context: BaseContext | None = None) -> None:
        # A 64-bit signed value: wraps only after 9.2e18 requests. The lock must come from the
        # same multiprocessing context as the worker processes (spawn).
        ctx = context or multiprocessing.get_context("spawn")
        self._value: Synchronized[int] = ctx.Value("q", 0)

    def fetch_add(self, n: int) -> int:
        with self._value.get_lock():
            old = self._value.value
            self._value.value = old + n
        return old


class CursorCounters:
    """The three routing counters of a proxy (encoder items, prefill slots, decode slots)."""

    def __init__(self, encode: Counter, prefill: Counter, decode: Counter) -> None:
        self.encode = encode
        self.prefill = prefill
        self.decode = decode

    @classmethod
    def local(cls) -> CursorCounters:
        return cls(LocalCounter(), LocalCounter(), LocalCounter())

    @classmethod
    def shared(cls, context: BaseContext | None = None) -> CursorCounters:
        """Counters that survive being passed to worker processes of ``context`` (spawn)."""
        return cls(SharedCounter(context), SharedCounter(context), SharedCounter(context))
