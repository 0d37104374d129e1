"""Which blocks each slot holds, by our key, and the longest cached prefix of a request per slot.

A slot is one engine: an (instance URL, DP rank) pair. Per slot the index keeps vLLM's block hash
only as an opaque id, mapped to our key (``keys.py``): to find a stored block's parent, and to
apply ``BlockRemoved``. Across slots it keeps one map, key -> bitmask of the slots holding it, so
a decision walks the request's keys once, intersecting masks, and stops when no slot is left:
the cost grows with the matched prefix, not with the number of slots or blocks indexed.

Rules (each chosen so the index under-counts rather than over-counts: routing to a slot for a
prefix it does not hold costs a recomputation and a worse guess next time; missing a hit costs
only the hit):

- A stored block whose parent the slot does not know (never seen, evicted by the cap, dropped
  after a loss) is not indexed, nor are its descendants in the same event: without the parent
  there is no key, and taking it for a root would match requests that merely start with the
  same tokens. Counted as ``orphans``.
- Only events for ``block_size``, the GPU medium and KV cache group ``group_idx`` are indexed
  (an offloaded CPU copy, or a sliding-window group's blocks, are not what a prefix hit on the
  GPU needs); the rest are counted as ``skipped``, like a BlockStored whose tokens do not cover
  its blocks. Unknown event types count as ``unknown``.
- Cap: at most ``max_blocks_per_slot`` blocks per slot, oldest stored first out (``evictions``).
  Per slot, so one busy engine cannot push out another's entries; set it at or above the
  engines' cache size (vLLM's ``num_gpu_blocks``) and it only bounds memory.
- Trust: ``FALLBACK`` until the slot's first batch (no events configured, or none received);
  ``EXACT`` once its history is seen from seq 0 (``fresh``); ``DEGRADED`` after events were lost
  (``lost``: entries dropped). Only exact slots report matches; the others count as holding
  nothing, so a policy can tell "no slot holds it" from "no slot is known".
- Rebuild: a degraded slot indexes the blocks stored after the loss (and sees their removal),
  so it never over-counts. What it misses are blocks cached before the loss: vLLM reports a
  block when it is stored, not when it is hit, so a prefix that stays hot (a shared system
  prompt) stays missing, with every block chained after it (orphans), until the engine evicts
  and recomputes it. No window makes such a slot exact; ``rebuild_window`` (30 s by default,
  configurable, a guess rather than a measurement) only bounds how long the slot is ignored
  entirely, after which it counts as exact and under-counts those prefixes: routing then leans
  away from it for them, never towards it wrongly. The window restarts at each loss. The cure
  is not to lose events: configure the replay endpoint (vLLM keeps 10,000 batches), or reset
  the engine's prefix cache, which is not the proxy's call.
- Speculation: after routing a request to a slot, ``speculate`` marks its keys held there for
  ``speculation_ttl`` (2 s by default, the issue's figure) so a burst of one prefix
  follows the first request before the engine reports the blocks. A real BlockStored of the key
  replaces it; expiry, ``lost``, ``fresh``, AllBlocksCleared and dropping the slot remove it.

Not thread-safe, no I/O: the caller (the subscriber shell, on the trio loop) passes ``now``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from .keys import ROOT_KEY, chain_keys
from .wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent

#: A routing slot: (instance URL, DP rank) in the proxy; any hashable value here.
Slot = Hashable

DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_BLOCKS_PER_SLOT = 262_144
DEFAULT_REBUILD_WINDOW = 30.0
DEFAULT_SPECULATION_TTL = 2.0
DEFAULT_MEDIA = frozenset({"GPU", None})
_MAX_MEMO_MASKS = 4096


class Trust(enum.Enum):
    EXACT = "exact"        # every event since the engine's start seen, or rebuilt since a loss
    DEGRADED = "degraded"  # events lost; entries dropped and being rebuilt: reports nothing
    FALLBACK = "fallback"  # no event received yet: reports nothing


@dataclass(slots=True)
class SlotStats:
    """Counters of one slot (a copy when read through ``KvIndex.stats``)."""

    trust: Trust = Trust.FALLBACK
    entries: int = 0
    speculative: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    skipped: int = 0
    unknown: int = 0
    evictions: int = 0
    losses: int = 0
    fresh_starts: int = 0


@dataclass(slots=True)
class _Slot:
    slot: Slot
    bit: int
    blocks: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    #: The blocks stored for each LoRA adapter (an event's ``lora_name``), so that a reload
    #: of the adapter under its name drops them (``drop_adapter``); base blocks are not here.
    adapters: dict[str, set[BlockHash]] = field(default_factory=dict)
    speculative: dict[int, float] = field(default_factory=dict)
    exact_at: float = float("inf")  # when a degraded slot becomes exact
    stats: SlotStats = field(default_factory=SlotStats)


class KvIndex:
    """The index over all slots. See the module docstring for the rules."""

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_blocks_per_slot: int = DEFAULT_MAX_BLOCKS_PER_SLOT,
                 rebuild_window: float = DEFAULT_REBUILD_WINDOW,
                 speculation_ttl: float = DEFAULT_SPECULATION_TTL,
                 media: Iterable[str | None] = DEFAULT_MEDIA, group_idx: int = 0) -> None:
        if block_size <= 0 or max_blocks_per_slot <= 0:
            raise ValueError("block_size and max_blocks_per_slot must be positive")
        self.block_size = block_size
        self.max_blocks_per_slot = max_blocks_per_slot
        self.rebuild_window = rebuild_window
        self.speculation_ttl = speculation_ttl
        self._media = frozenset(media)
        self._group_idx = group_idx
        self._slots: dict[Slot, _Slot] = {}
        self._by_bit: dict[int, _Slot] = {}
        self._free_bits: list[int] = []
        self._held: dict[int, int] = {}         # key -> slots holding it (events)
        self._speculated: dict[int, int] = {}   # key -> slots it was routed to (speculation)
        self._expiries: deque[tuple[float, _Slot, Sequence[int]]] = deque()
        self._exact = 0                          # bitmask of the exact slots
        self._next_promotion = float("inf")
        self._slots_of_mask: dict[int, tuple[Slot, ...]] = {}

    # --- slots ------------------------------------------------------------------------------

    def add_slot(self, slot: Slot) -> None:
        """A slot to index (FALLBACK until its first batch). Adding a known slot does nothing."""
        if slot in self._slots:
            return
        bit = self._free_bits.pop() if self._free_bits else len(self._slots)
        state = _Slot(slot, bit)
        self._slots[slot] = state
        self._by_bit[bit] = state
        self._slots_of_mask.clear()

    def drop_slot(self, slot: Slot) -> None:
        """Forget a slot (it left the roster, or its subscriber stopped). Unknown: nothing."""
        state = self._slots.pop(slot, None)
        if state is None:
            return
        self._reset(state)
        self._exact &= ~(1 << state.bit)
        del self._by_bit[state.bit]
        self._free_bits.append(state.bit)
        self._slots_of_mask.clear()

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def trust(self, slot: Slot) -> Trust:
        return self._slots[slot].stats.trust

    def stats(self, slot: Slot) -> SlotStats:
        state = self._slots[slot]
        return replace(state.stats, entries=len(state.blocks), speculative=len(state.speculative))

    def fresh(self, slot: Slot, now: float) -> None:
        """The slot's events are seen from its engine's seq 0 on: start empty, exact."""
        state = self._slots.get(slot)
        if state is None:
            return
        self._reset(state)
        state.stats.fresh_starts += 1
        self._set_trust(state, Trust.EXACT)

    def lost(self, slot: Slot, now: float) -> None:
        """Events of the slot were lost for good: drop its entries, degraded until rebuilt."""
        state = self._slots.get(slot)
        if state is None:
            return
        self._reset(state)
        state.stats.losses += 1
        self._set_trust(state, Trust.DEGRADED)
        state.exact_at = now + self.rebuild_window
        self._next_promotion = min(self._next_promotion, state.exact_at)

    # --- events -----------------------------------------------------------------------------

    def apply(self, slot: Slot, events: Iterable[KvEvent]) -> None:
        """Apply one batch's events to a slot (an unknown slot: ignored). Never raises on what
        ``wire.decode_batch`` returns."""
        state = self._slots.get(slot)
        if state is None:
            return
        stats = state.stats
        for event in events:
            stats.events += 1
            kind = type(event)
            if kind is BlockStored:
                self._stored(state, event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._removed(state, event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                stats.cleared += 1
                self._reset(state)
            else:
                stats.unknown += 1

    def _stored(self, state: _Slot, event: BlockStored) -> None:
        size = self.block_size
        hashes = event.block_hashes
        if (event.block_size != size or event.medium not in self._media
                or (event.group_idx or 0) != self._group_idx
                or len(event.token_ids) != len(hashes) * size
                or (event.extra_keys is not None and len(event.extra_keys) != len(hashes))):
            state.stats.skipped += 1
            return
        blocks = state.blocks
        parent = event.parent_block_hash
        parent_key = ROOT_KEY if parent is None else blocks.get(parent)
        if parent_key is None:
            state.stats.orphans += len(hashes)
            return
        held = self._held
        bit = 1 << state.bit
        lora = state.adapters.setdefault(event.lora_name, set()) if event.lora_name else None
        for block_hash, key in zip(hashes, chain_keys(parent_key, event.token_ids, size,
                                                      event.extra_keys), strict=True):
            old = blocks.pop(block_hash, None)
            if old is not None and old != key:
                self._unhold(old, bit)
            blocks[block_hash] = key
            if lora is not None:
                lora.add(block_hash)
            held[key] = held.get(key, 0) | bit
            if state.speculative and state.speculative.pop(key, None) is not None:
                self._unspeculate(key, bit)
        state.stats.stored += len(hashes)
        overflow = len(blocks) - self.max_blocks_per_slot
        for _ in range(max(overflow, 0)):
            block_hash, key = blocks.popitem(last=False)
            self._unhold(key, bit)
            self._forget_lora(state, block_hash)
            state.stats.evictions += 1

    def _removed(self, state: _Slot, event: BlockRemoved) -> None:
        if event.medium not in self._media or (event.group_idx or 0) != self._group_idx:
            state.stats.skipped += 1
            return
        bit = 1 << state.bit
        for block_hash in event.block_hashes:
            key = state.blocks.pop(block_hash, None)
            if key is not None:
                # Another of the slot's blocks may have the same key (only if vLLM's hashes
                # differ where ours do not): clearing the bit then under-counts, as allowed.
                self._unhold(key, bit)
                self._forget_lora(state, block_hash)
                state.stats.removed += 1

    @staticmethod
    def _forget_lora(state: _Slot, block_hash: BlockHash) -> None:
        if state.adapters:
            for held in state.adapters.values():
                held.discard(block_hash)

    def drop_adapter(self, slot: Slot, adapter: str) -> int:
        """Forget every block ``slot`` stored for the LoRA ``adapter``: it was loaded again
        under the same name (vllm #42125: its blocks would still match, stale). How many
        blocks went. The slot keeps its trust state: what it holds of the base and of other
        adapters is still exact."""
        state = self._slots.get(slot)
        if state is None:
            return 0
        dropped = 0
        bit = 1 << state.bit
        for block_hash in state.adapters.pop(adapter, set()):
            key = state.blocks.pop(block_hash, None)
            if key is not None:
                self._unhold(key, bit)
                dropped += 1
        return dropped

    def _unhold(self, key: int, bit: int) -> None:
        mask = self._held.get(key, 0) & ~bit
        if mask:
            self._held[key] = mask
        else:
            self._held.pop(key, None)

    def _unspeculate(self, key: int, bit: int) -> None:
        mask = self._speculated.get(key, 0) & ~bit
        if mask:
            self._speculated[key] = mask
        else:
            self._speculated.pop(key, None)

    def _reset(self, state: _Slot) -> None:
        bit = 1 << state.bit
        for key in state.blocks.values():
            self._unhold(key, bit)
        state.blocks.clear()
        state.adapters.clear()
        for key in state.speculative:
            self._unspeculate(key, bit)
        state.speculative.clear()

    def _set_trust(self, state: _Slot, trust: Trust) -> None:
        state.stats.trust = trust
        state.exact_at = float("inf")
        if trust is Trust.EXACT:
            self._exact |= 1 << state.bit
        else:
            self._exact &= ~(1 << state.bit)

    # --- decisions --------------------------------------------------------------------------

    def match(self, keys: Sequence[int], now: float) -> dict[Slot, int]:
        """Tokens of the longest cached prefix of ``keys`` (a request's block keys) per exact
        slot holding at least its first block; a slot not listed holds none of it."""
        if now >= self._next_promotion or (self._expiries and self._expiries[0][0] <= now):
            self.refresh(now)  # (tested inline: a call costs a tenth of a short decision)
        alive = self._exact
        matched: dict[Slot, int] = {}
        if not alive or not keys:
            return matched
        held = self._held.get
        speculated = self._speculated.get if self._speculated else None
        # One lookup per key, stopping when no slot is left. Measured against bisecting per
        # group of slots (which needs vLLM's "a cached block's parent is cached" to hold) and
        # against an AND-accumulation in C: neither was faster on 8-64 block prompts.
        depth = 0
        for key in keys:
            mask = held(key, 0)
            if speculated is not None:
                mask |= speculated(key, 0)
            mask &= alive
            if mask != alive:
                if depth:
                    self._record(matched, alive & ~mask, depth)
                alive = mask
                if not alive:
                    return matched
            depth += 1
        self._record(matched, alive, depth)
        return matched

    def _record(self, matched: dict[Slot, int], bits: int, depth: int) -> None:
        slots = self._slots_of_mask.get(bits)
        if slots is None:
            slots = self._slots_of(bits)
        matched.update(dict.fromkeys(slots, depth * self.block_size))

    def _slots_of(self, bits: int) -> tuple[Slot, ...]:
        # Memoised: the same few masks (all slots, the slots of one instance...) recur in every
        # decision, and building the tuple bit by bit cost more than the key walk. Cleared when
        # a bit changes owner; bounded (16 slots make 65536 masks).
        if len(self._slots_of_mask) >= _MAX_MEMO_MASKS:
            self._slots_of_mask.clear()
        slots = []
        rest = bits
        while rest:
            low = rest & -rest
            slots.append(self._by_bit[low.bit_length() - 1].slot)
            rest ^= low
        self._slots_of_mask[bits] = found = tuple(slots)
        return found

    def speculate(self, slot: Slot, keys: Sequence[int], now: float) -> None:
        """The request with these keys was routed to ``slot``: count them held there until a
        real event says so, or ``speculation_ttl`` passes. Non-exact slots: nothing (they report
        nothing anyway)."""
        state = self._slots.get(slot)
        if state is None or state.stats.trust is not Trust.EXACT or not keys:
            return
        self.refresh(now)
        expiry = now + self.speculation_ttl
        bit = 1 << state.bit
        for key in keys:
            state.speculative[key] = expiry
            self._speculated[key] = self._speculated.get(key, 0) | bit
        self._expiries.append((expiry, state, tuple(keys)))

    def refresh(self, now: float) -> None:
        """Apply what time does: degraded slots whose rebuild window passed become exact, and
        expired speculations go. ``match`` and ``speculate`` call it; call it before reading
        ``trust`` or ``stats`` when the answer must be current."""
        if now >= self._next_promotion:
            self._promote(now)
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expiry, state, keys = expiries.popleft()
            if self._by_bit.get(state.bit) is not state:
                continue  # the slot was dropped since
            bit = 1 << state.bit
            for key in keys:
                if state.speculative.get(key) == expiry:
                    del state.speculative[key]
                    self._unspeculate(key, bit)

    def _promote(self, now: float) -> None:
        upcoming = float("inf")
        for state in self._slots.values():
            if state.stats.trust is Trust.DEGRADED:
                if state.exact_at <= now:
                    self._set_trust(state, Trust.EXACT)
                else:
                    upcoming = min(upcoming, state.exact_at)
        self._next_promotion = upcoming
