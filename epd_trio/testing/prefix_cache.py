"""One DP rank's prefix cache, as the fake vLLM and the simulated engine keep it (no I/O).

A prompt's full blocks get hashes chained over the blocks before them; a request's cached
prefix is its leading blocks found in the cache; the blocks after it are stored, and the least
recently used blocks are evicted past ``capacity``. When events are recorded it says so the
way vLLM's ``BlockPool`` does (``vllm/v1/core/block_pool.py``): one ``BlockStored`` for the
blocks a request newly caches (from its first miss on, parent = the last hit block), never for
blocks it reused; a ``BlockRemoved`` for evicted blocks (before the store that needed the room);
``AllBlocksCleared`` on a reset. The events are the proxy's own types (``epd_trio._kv.wire``),
built as vLLM fills them for a plain decoder model (medium ``"GPU"``, group 0), with lists.

The hashes are seeded per instance so nobody outside can recompute them (vLLM's are as opaque
to a proxy: a random ``NONE_HASH`` or a hash of CBOR it does not reproduce); Python's ``hash``
of int tuples keeps this cheap for the bench. Simplifications: one physical block per hash (vLLM
may cache a duplicate and later remove it twice), and eviction is LRU over requests' blocks,
each request's touched tail first (vLLM frees a finished request's blocks tail first, so its
tail is evicted before its head), at admission rather than when the request ends.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from .._kv.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, ExtraKeys, KvEvent

_MASK = (1 << 64) - 1
#: Where a cache's events go, one call per engine step: ``sink(dp_rank, events)``. The
#: publisher's ``publish`` is one; the bench can pass its index's method instead.
EventSink = Callable[[int, Sequence[KvEvent]], object]


def new_seed() -> int:
    """A hash seed for one instance (all its ranks share it, as one vLLM's engines would)."""
    return random.getrandbits(64)


def chained_hashes(tokens: Sequence[Hashable], block_size: int, *, seed: int,
                   extra_keys: Sequence[ExtraKeys] | None = None) -> list[int]:
    """The unsigned 64-bit hashes of ``tokens``'s full blocks, each over its parent's hash, its
    tokens and its extra keys (a partial last block is never cached)."""
    hashes, parent = [], seed
    for index, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        extra = extra_keys[index] if extra_keys is not None else None
        parent = hash((parent, tuple(tokens[start:start + block_size]), extra)) & _MASK
        hashes.append(parent)
    return hashes


class PrefixCache:
    """The LRU of block hashes of one rank, with its vLLM counters (tokens)."""

    def __init__(self, *, block_size: int, capacity: int, record_events: bool = False) -> None:
        self.block_size = block_size
        self.capacity = capacity
        #: Record events for ``take_events`` (off: no event is built at all).
        self.record_events = record_events
        self.blocks: OrderedDict[int, None] = OrderedDict()
        #: ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, in tokens.
        self.queries = 0
        self.hits = 0
        self._events: list[KvEvent] = []

    def __len__(self) -> int:
        return len(self.blocks)

    def admit(self, hashes: Sequence[int], prompt_tokens: int, *, store: bool = True,
              token_ids: Sequence[int] = (), extra_keys: Sequence[ExtraKeys] | None = None,
              hit_limit: int | None = None) -> int:
        """Count one request's lookup and return its cached prefix, in tokens; with ``store``,
        cache its blocks. ``hit_limit`` caps the hit in tokens: vLLM looks up at most
        ``prompt_tokens - 1`` so the last token is always computed. ``token_ids`` and
        ``extra_keys`` are only read for the events."""
        blocks, size = self.blocks, self.block_size
        limit = len(hashes) if hit_limit is None else min(len(hashes), max(hit_limit, 0) // size)
        hit = 0
        while hit < limit and hashes[hit] in blocks:
            hit += 1
        self.queries += prompt_tokens
        self.hits += hit * size
        if store and hashes:
            self._store(hashes, hit, token_ids, extra_keys)
        return hit * size

    def _store(self, hashes: Sequence[int], hit: int, token_ids: Sequence[int],
               extra_keys: Sequence[ExtraKeys] | None) -> None:
        blocks = self.blocks
        for block in hashes[:hit]:  # out of eviction's way: this request holds them
            blocks.move_to_end(block)
        new = [block for block in hashes[hit:] if block not in blocks]
        mine = set(hashes)
        removed = []
        while blocks and len(blocks) + len(new) > self.capacity:
            oldest = next(iter(blocks))
            if oldest in mine:  # a request larger than the cache: keep its own blocks
                break
            blocks.popitem(last=False)
            removed.append(oldest)
        # Touched tail first, so the request's first block is its most recent: eviction takes a
        # request's tail before its head, as vLLM's free queue does (it frees a finished
        # request's blocks in reverse), and a shared prefix outlives the prompts behind it.
        for block in reversed(hashes):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        if self.record_events:
            if removed:
                self._events.append(BlockRemoved(removed, MEDIUM_GPU, 0))
            if hit < len(hashes):
                size = self.block_size
                extra = (list(extra_keys[hit:len(hashes)]) if extra_keys is not None
                         else [None] * (len(hashes) - hit))
                self._events.append(BlockStored(
                    block_hashes=list(hashes[hit:]),
                    parent_block_hash=hashes[hit - 1] if hit else None,
                    token_ids=list(token_ids[hit * size:len(hashes) * size]),
                    block_size=size, extra_keys=extra, medium=MEDIUM_GPU, group_idx=0))

    def clear(self) -> None:
        """Drop every block (``POST /reset_prefix_cache``): one ``AllBlocksCleared``."""
        self.blocks.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call (one engine step's batch)."""
        events, self._events = self._events, []
        return events
