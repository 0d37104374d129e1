"""The fake vLLM's prefix cache and KV events: opt-in, so the default fake costs nothing more.

``FakeVLLM(kv=KVConfig(...))`` turns on what a proxy routing on the engines' caches depends on:
prompts become token ids through ``render`` (the same ids ``/v1/.../render`` answers), each DP
rank keeps a prefix cache (``prefix_cache.PrefixCache``; the simulated engine's own when the
fake has one), its events go to a ``KVEventPublisher`` (vLLM's ZMQ wire) and/or an in-process
sink, ``/metrics`` counts ``vllm:prefix_cache_queries`` / ``_hits`` and, with
``prompt_tokens_details``, ``usage.prompt_tokens_details.cached_tokens`` reports the hit
(vLLM's ``--enable-prompt-tokens-details``).

A decode that pulled its prompt's KV from a prefill (``do_remote_prefill``) stores those blocks
too when ``decode_stores_remote`` is on, as vLLM's decode caches the blocks a KV connector loaded:
a claim still to be checked against real vLLM, hence the knob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._kv.wire import KvEvent
from .kv_publisher import KVEventPublisher
from .prefix_cache import EventSink, PrefixCache, chained_hashes, new_seed
from .render import DEFAULT_PLACEHOLDER_TOKENS, Rendered
from .sim_engine import SimEngine

#: vLLM's block size on the CPU backend (it accepts only multiples of 32 there).
DEFAULT_BLOCK_SIZE = 32
DEFAULT_CAPACITY_BLOCKS = 4096


@dataclass
class KVConfig:
    """What the fake's prefix cache is and where its events go."""

    #: Tokens per block. None: the engine's ``block_tokens``, or 32 without an engine.
    block_size: int | None = None
    #: Blocks one rank keeps. None: the engine's ``cache_blocks``, or 4096.
    capacity_blocks: int | None = None
    #: Publish events on vLLM's ZMQ wire (``FakeVLLM.serve`` starts it; its dp_size must match).
    publisher: KVEventPublisher | None = None
    #: And/or hand them to this callable in-process, ``sink(dp_rank, events)`` (the bench).
    sink: EventSink | None = None
    #: A decode that received the KV from a prefill caches (and reports) those blocks.
    decode_stores_remote: bool = True
    #: ``usage.prompt_tokens_details = {"cached_tokens": n}`` (vLLM: None unless enabled).
    prompt_tokens_details: bool = False
    #: Pad tokens per media item in the rendered prompt.
    placeholder_tokens: int = DEFAULT_PLACEHOLDER_TOKENS
    #: The block hash seed (None: random per instance, so no proxy can recompute the hashes).
    seed: int | None = None


class FakeKV:
    """The state behind a ``KVConfig``: per-rank caches (or the engine's) and the sink."""

    def __init__(self, config: KVConfig, dp_size: int, engine: SimEngine | None) -> None:
        self.config = config
        self.engine = engine
        sinks = [s for s in (config.publisher.publish if config.publisher else None, config.sink)
                 if s is not None]
        if config.publisher is not None and config.publisher.dp_size != dp_size:
            raise ValueError(f"the KV publisher has dp_size {config.publisher.dp_size}, "
                             f"the fake {dp_size}")
        if engine is not None:
            ec = engine.config
            for name, mine, theirs in (("block_size", config.block_size, ec.block_tokens),
                                       ("capacity_blocks", config.capacity_blocks, ec.cache_blocks)):
                if mine is not None and mine != theirs:
                    raise ValueError(f"KVConfig.{name}={mine} but the engine has {theirs}")
            if engine.event_sink is not None:
                sinks.append(engine.event_sink)
            self.block_size = ec.block_tokens
            self.seed = engine.seed if config.seed is None else config.seed
            engine.seed = self.seed
            self.caches = [rank.cache for rank in engine.ranks]
        else:
            self.block_size = config.block_size or DEFAULT_BLOCK_SIZE
            self.seed = new_seed() if config.seed is None else config.seed
            capacity = config.capacity_blocks or DEFAULT_CAPACITY_BLOCKS
            self.caches = [PrefixCache(block_size=self.block_size, capacity=capacity)
                           for _ in range(dp_size)]
        self.sink: EventSink | None = _fan_out(sinks)
        if engine is not None:
            engine.event_sink = self.sink
        for cache in self.caches:
            cache.record_events = self.sink is not None

    def stores(self, remote: bool) -> bool:
        """Whether a request caches its blocks (a remote-KV decode only with the knob)."""
        return not remote or self.config.decode_stores_remote

    def admit(self, rank: int, rendered: Rendered, *, store: bool) -> int:
        """One request on a fake without engine: its cached prefix in tokens; its events are
        published as one batch (vLLM: one batch per engine step)."""
        tokens = rendered.token_ids
        cache = self.caches[rank]
        extra = rendered.extra_keys(self.block_size)
        hashes = chained_hashes(tokens, self.block_size, seed=self.seed, extra_keys=extra)
        cached = cache.admit(hashes, len(tokens), store=store, token_ids=tokens, extra_keys=extra,
                             hit_limit=len(tokens) - 1)
        self.flush(rank)
        return cached

    def flush(self, rank: int) -> None:
        events = self.caches[rank].take_events()
        if events and self.sink is not None:
            self.sink(rank, events)

    def reset(self, rank: int | None = None) -> None:
        """``POST /reset_prefix_cache``: every block dropped, ``AllBlocksCleared`` sent."""
        for index in range(len(self.caches)) if rank is None else (rank,):
            self.caches[index].clear()
            self.flush(index)

    def restart(self, rank: int | None = None, *, clear: bool = False) -> None:
        """Like a restarted vLLM: the cache empty without a word, the event sequence from 0
        (``clear``: an ``AllBlocksCleared`` first)."""
        for index in range(len(self.caches)) if rank is None else (rank,):
            self.caches[index].blocks.clear()
        if self.config.publisher is not None:
            self.config.publisher.restart(rank, clear=clear)

    def metrics_text(self, model: str) -> str:
        """vLLM's prefix-cache counters, one series per rank (a fake without engine)."""
        lines = []
        for name, values in (("vllm:prefix_cache_queries", [c.queries for c in self.caches]),
                             ("vllm:prefix_cache_hits", [c.hits for c in self.caches])):
            lines.append(f"# TYPE {name} counter")
            lines += [f'{name}_total{{engine="{rank}",model_name="{model}"}} {float(value)}'
                      for rank, value in enumerate(values)]
        return "\n".join(lines) + "\n"


def _fan_out(sinks: Sequence[EventSink]) -> EventSink | None:
    if not sinks:
        return None
    if len(sinks) == 1:
        return sinks[0]

    def both(rank: int, events: Sequence[KvEvent]) -> None:
        for sink in sinks:
            sink(rank, events)

    return both
