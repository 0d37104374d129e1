"""LoRA adapters loaded on demand (``EPD_LORA_LOAD``): one load per adapter and stage at a time.

When a request names a configured adapter (``[adapters."X"]``) that no live instance of a stage
it needs holds, the proxy loads it on the instance the pool's policy picks for that stage
(``POST /v1/load_lora_adapter`` with ``lora_name`` and ``lora_path``; vLLM answers a plain-text
success), then routes. In a disaggregated layout the adapter must be on the prefill **and** the
decode instance, so each stage that lacks it gets a load. Why one at a time per adapter and
stage: fifty requests arriving together for an adapter nobody holds must not load it on every
instance the rotation passes: the first picks the instance and loads, the others wait for that
load and route to it. A successful load is what the instance now serves, written into the
roster like a ``/v1/models`` answer, so every worker routes to it at once, and the KV index drops
whatever it held under that name there (a reload). The proxy never unloads: vLLM swaps
adapters itself (``--max-loras``, ``--max-cpu-loras``).

Failure: a load that fails (vLLM's 400, 404 or 500, a transport error, a timeout) answers the
request, and every request waiting on it, 503 ``adapter_load_failed`` with vLLM's message and
the instance's URL; that instance is not asked again for that adapter for
``EPD_HEALTH_INTERVAL`` seconds (the next request picks another one). Cancellation: a request
that leaves while its load runs does not cancel it (the load belongs to every waiter); the load
has its own deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from .._core.errors import AdapterLoadFailed, UpstreamError
from .._core.roster import Card
from .._core.routing import Instance
from .tables import AdapterTable

log = logging.getLogger("epd_trio")

#: The one call: POST ``body`` to ``instance``'s ``/v1/load_lora_adapter`` within the deadline;
#: ``UpstreamError`` when it is not a 2xx (vLLM's body in it).
PostLoad = Callable[[str, Instance, dict[str, str]], Awaitable[object]]


@dataclass(slots=True)
class _Load:
    """A load under way: its instance, and how it ended (None: it has not yet)."""

    instance: Instance
    done: trio.Event
    error: AdapterLoadFailed | None = None


class AdapterLoader:
    """The loads of one process (see the module): at most one per adapter and stage at a time,
    and the instances that failed one recently."""

    def __init__(self, post: PostLoad, learned: Callable[[str, Card], None], *,
                 retry_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``learned(url, card)``: the instance at ``url`` now holds ``card`` (into the
        roster). ``retry_after``: seconds an instance that failed a load is not asked again
        for that adapter."""
        self._post = post
        self._learned = learned
        self._retry_after = retry_after
        self._clock = clock
        self._loads: dict[tuple[str, str], _Load] = {}
        self._failed: dict[tuple[str, str], float] = {}
        #: Loads answered 200, by ``(url, adapter)`` (the tests count them).
        self.loaded: list[tuple[str, str]] = []

    def may_load(self, url: str, adapter: str) -> bool:
        """Whether the instance at ``url`` may be asked to load ``adapter`` now."""
        until = self._failed.get((url, adapter))
        if until is None:
            return True
        if self._clock() >= until:
            del self._failed[(url, adapter)]
            return True
        return False

    def loading(self, adapter: str, stage: str) -> _Load | None:
        """The load of ``adapter`` for ``stage`` under way, if one is."""
        return self._loads.get((adapter, stage))

    async def wait(self, load: _Load) -> None:
        """Until ``load`` ended; its failure raised here too."""
        await load.done.wait()
        if load.error is not None:
            raise load.error

    async def load(self, table: AdapterTable, stage: str, instance: Instance) -> None:
        """Load ``table``'s adapter on ``instance`` for ``stage`` (the caller checked no load
        for it is under way: ``loading``), and wait for it. Shielded: the requests waiting on
        it do not cancel each other's load."""
        key = (table.name, stage)
        load = self._loads[key] = _Load(instance, trio.Event())
        try:
            with trio.CancelScope(shield=True):
                try:
                    await self._post(stage, instance, {"lora_name": table.name,
                                                       "lora_path": table.path})
                except UpstreamError as exc:
                    self._failed[(instance.url, table.name)] = self._clock() + self._retry_after
                    load.error = AdapterLoadFailed(table.name, stage, instance.url, exc.message)
                    log.warning("%s", load.error.message)
                else:
                    self.loaded.append((instance.url, table.name))
                    self._learned(instance.url, Card(table.name, table.path, table.base))
                    log.info("adapter %s loaded at %s instance %s", table.name, stage,
                             instance.url)
        finally:
            del self._loads[key]
            load.done.set()
        if load.error is not None:
            raise load.error
