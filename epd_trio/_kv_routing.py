"""Routing on what the engines hold: the KV index's subscriptions and each request's lookup.

``precise_cache_aware`` and the prefill bypass need two things no other part of the proxy has:
what every prefill and decode slot holds in its KV cache (vLLM's KV cache events, one publisher
per DP rank, followed by ``_kv.subscriber.KvEvents`` into one ``KvIndex``), and a request's
token ids (vLLM's render endpoint: the proxy never tokenizes, so it never disagrees with the
engine's chat template). ``KvRouting`` owns both for one proxy process.

Why each worker process subscribes itself (``epd-trio serve --workers N``), rather than one
process sharing its index: an index shared through memory would need a cross-process lock on
every lookup and every event, and a lookup is the request path; a subscription costs each
worker the decoding of every event, which ``bench.kv_index`` measures (docs/how-to/kv-routing.md).
Replicas likewise each subscribe: they need nothing from Redis for this.

The slots followed are the roster's, pulled like everything else (``follow`` at each new roster
version, from ``Proxy.sync``); the subscriptions change in this object's own task (``run``,
started in the proxy's background nursery), never on the request path.

Failure: a render that fails, answers something unusable or is slower than
``EPD_RENDER_TIMEOUT`` returns no lookup, and that request is routed by ``cache_aware``: it is
never failed for it. Cancellation (the client left) passes through untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson
import trio

from ._core.config import Settings
from ._core.errors import UpstreamError, UpstreamTimeout
from ._core.policies import CachedPrefix, SlotKey
from ._core.rewrite import upstream_headers
from ._core.roster import Roster
from ._core.routing import Instance, KvEventEndpoints
from ._kv.index import KvIndex, Trust
from ._kv.prompt import rendered_prompt
from ._kv.subscriber import KvEvents, SlotSource
from ._models.pools import Pool
from ._observe.metrics import ProxyMetrics
from ._upstream.legs import post_json
from ._upstream.pool import UpstreamPool

log = logging.getLogger("epd_trio.kv_events")

#: The stages whose slots hold a prompt's KV cache.
KV_STAGES = ("prefill", "decode")


class Decisions(Protocol):
    """The request's account: where the render call and a decision on the index are told."""

    def render(self, instance: Instance) -> AbstractContextManager[dict[str, str]]: ...

    def kv_decided(self, stage: str, trust: str, prompt_tokens: int,
                   cached_tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class KvLookup:
    """What the index says of one request: the tokens each exact slot holds, and the request's
    block keys (the chosen slot's speculative entries)."""

    cached: CachedPrefix
    keys: Sequence[int]


def kv_endpoints(instance: Instance, settings: Settings) -> KvEventEndpoints | None:
    """Where ``instance`` publishes its KV events: what it named itself, else its own host at
    ``EPD_KV_EVENTS_PORT`` (and ``EPD_KV_EVENTS_REPLAY_PORT``); None: nowhere known."""
    if instance.kv_events is not None:
        return instance.kv_events
    if not settings.kv_events_port:
        return None
    host = urlsplit(instance.url).hostname or ""
    host = f"[{host}]" if ":" in host else host
    replay = settings.kv_events_replay_port
    return KvEventEndpoints(f"tcp://{host}:{settings.kv_events_port}",
                            f"tcp://{host}:{replay}" if replay else None)


def slot_sources(roster: Roster, settings: Settings) -> list[SlotSource]:
    """One subscription per prefill and decode slot whose engine publishes somewhere known,
    each at its DP rank's own port (``KvEventEndpoints.for_rank``)."""
    sources = []
    for member in roster.members:
        if member.stage not in KV_STAGES:
            continue
        instance = member.instance
        endpoints = kv_endpoints(instance, settings)
        if endpoints is None:
            continue
        for rank in range(instance.dp_size):
            slot: SlotKey = (instance.url, rank if instance.dp_size > 1 else None)
            try:
                ranked = endpoints.for_rank(rank)
            except ValueError as exc:  # a port past 65535: that rank publishes nowhere known
                log.warning("no KV events for %s rank %d: %s", instance.url, rank, exc)
                continue
            sources.append(SlotSource(slot, ranked.publish, ranked.replay))
    return sources


class KvRouting:
    """The KV index of one proxy process, its subscriptions, and the render call."""

    def __init__(
        self, settings: Settings, *, pools: Callable[[Instance], UpstreamPool],
        metrics: ProxyMetrics, render_targets: Callable[[Pool], Sequence[Instance]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``render_targets``: the instances a render of a request of a model's pool may go to
        now (``EPD_RENDER_URLS``, else the pool's live instances: they have its tokenizer);
        taken in turn."""
        self.settings = settings
        self.events = KvEvents(KvIndex(block_size=settings.kv_block_size,
                                       max_blocks_per_slot=settings.kv_index_blocks),
                               replay_timeout=settings.kv_replay_timeout, clock=clock)
        self._pools = pools
        self._metrics = metrics
        self._render_targets = render_targets
        self._render_turn = 0
        self._wanted: list[SlotSource] = []
        self._followed: set[Any] = set()
        self._changed = trio.Event()

    # -- the slots followed ------------------------------------------------------------------
    def follow(self, roster: Roster) -> None:
        """A new roster version: the slots to subscribe to, taken up by ``run``."""
        wanted = slot_sources(roster, self.settings)
        if wanted != self._wanted:
            self._wanted = wanted
            self._changed.set()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The subscriptions, following ``follow``, until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.events.run)
            while True:
                self._changed = trio.Event()
                wanted = self._wanted
                await self.events.reconcile(wanted)
                self._followed = {source.slot for source in wanted}
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                await self._changed.wait()

    async def until_exact(self, count: int) -> None:
        """Until ``count`` slots are followed and every one is exact (each having asked its
        replay socket first): where a bench or a test starts sending, instead of sleeping."""
        events = self.events

        def exact() -> bool:
            reports = events.stats()
            return len(reports) == count and all(report.index.trust is Trust.EXACT
                                                 for report in reports.values())
        await events.wait_until(exact)

    def trust(self, slot: SlotKey) -> Trust:
        """A slot's trust state; a slot with no subscription is ``FALLBACK``."""
        return self.events.index.trust(slot) if slot in self._followed else Trust.FALLBACK

    # -- one request ---------------------------------------------------------------------------
    async def lookup(self, path: str, body: dict[str, Any], request_id: str,
                     account: Decisions, pool: Pool, adapter: str | None = None,
                     ) -> KvLookup | None:
        """What the engines hold of this request's prompt, or None (no render to be had in
        time, or a request the index cannot key): route it by ``cache_aware`` then. ``pool``:
        the request's model's, whose instances render it. ``adapter``: the LoRA adapter it
        names, rendered with its base model's name (the tokenizer is the base's) and keyed
        with the adapter's name, as vLLM keys its blocks: a base prompt never matches an
        adapter's blocks, nor one adapter another's."""
        if adapter is not None:
            body = {**body, "model": pool.model}
        answer = await self._render(path, body, request_id, account, pool)
        if answer is None:
            return None
        started = time.perf_counter()
        try:
            prompt = rendered_prompt(answer)
        except ValueError as exc:
            log.debug("request %s: render answer not usable: %s", request_id, exc)
            return None
        if prompt is None:
            return None
        salt = body.get("cache_salt")
        keys = prompt.keys(self.events.index.block_size,
                           cache_salt=salt if isinstance(salt, str) else None, lora_name=adapter)
        cached = CachedPrefix.reusable(len(prompt.token_ids), self.events.match(keys),
                                       self.events.index.block_size)
        self._metrics.looked_up(time.perf_counter() - started)
        return KvLookup(cached, keys)

    async def _render(self, path: str, body: dict[str, Any], request_id: str,
                      account: Decisions, pool: Pool) -> Any:
        targets = self._render_targets(pool)
        if not targets:
            return None
        instance = targets[self._render_turn % len(targets)]
        self._render_turn += 1
        started = time.perf_counter()
        outcome = "ok"
        try:
            with account.render(instance) as traced:
                answer = await post_json(
                    self._pools(instance), stage="render", instance=instance,
                    path=f"{path}/render", body=body,
                    headers={**upstream_headers(request_id, None), **traced},
                    deadline=self.settings.render_timeout)
            return orjson.loads(answer.content)
        except (UpstreamError, orjson.JSONDecodeError) as exc:
            outcome = "timeout" if isinstance(exc, UpstreamTimeout) else "error"
            log.debug("request %s: render on %s failed: %s", request_id, instance.url, exc)
            return None
        finally:
            self._metrics.rendered(outcome, time.perf_counter() - started)

    def decided(self, stage: str, slot: SlotKey, lookup: KvLookup, account: Decisions) -> None:
        """A slot was chosen on the index: tell the request's ``account`` (its trust state,
        what it held), and insert the blocks it is about to store for a short while, so a
        burst of one prefix does not scatter while its events are in flight (vllm-router does
        this for 2 s)."""
        cached = lookup.cached
        trust = self.trust(slot)
        account.kv_decided(stage, trust.value, cached.prompt_tokens, cached.held.get(slot, 0))
        if trust is Trust.EXACT:
            self.events.speculate(slot, lookup.keys)

    def drop_adapter(self, url: str, adapter: str) -> None:
        """Forget what every slot of the instance at ``url`` stored for ``adapter``: it was
        loaded again under the same name (or went): its blocks must never be routed to."""
        dropped = sum(self.events.index.drop_adapter(slot, adapter)
                      for slot in self._followed if slot[0] == url)
        if dropped:
            log.info("KV index: %d blocks of adapter %s at %s dropped (reloaded under its name)",
                     dropped, adapter, url)

    # -- what an operator sees -----------------------------------------------------------------
    def report(self) -> dict[SlotKey, dict[str, Any]]:
        """Each followed slot's trust state and counts (``GET /instances``)."""
        found = {}
        for slot, stats in self.events.stats().items():
            found[slot] = {"trust": stats.index.trust.value, "blocks": stats.index.entries,
                           "events": stats.index.events, "gaps": stats.gaps,
                           "replays": stats.replays, "endpoint": stats.source.endpoint}
        return found

    def publish_stats(self) -> None:
        """The per-slot gauges, from a housekeeping round (not the request path)."""
        self._metrics.kv_slots(
            (url, "" if rank is None else str(rank), entry["trust"], entry["blocks"],
             {name: entry[name] for name in ("events", "gaps", "replays")})
            for (url, rank), entry in self.report().items())
