"""The index: events in, longest cached prefix per slot out, with its trust, cap and speculation."""

from __future__ import annotations

from typing import Any

import pytest
from kv_helpers import BLOCK, extras_for, prompt, stored

from epd_trio._kv.index import KvIndex, Trust
from epd_trio._kv.keys import MediaFeature, request_keys
from epd_trio._kv.wire import (
    AllBlocksCleared,
    BlockRemoved,
    UnknownEvent,
    decode_batch,
    encode_batch,
)

A, B, C = ("http://p0:8000", 0), ("http://p0:8000", 1), ("http://p1:8000", 0)


def index_with(*slots: Any, now: float = 0.0, **options: Any) -> KvIndex:
    """An index whose slots are exact (their history seen from seq 0)."""
    index = KvIndex(block_size=BLOCK, **options)
    for slot in slots:
        index.add_slot(slot)
        index.fresh(slot, now)
    return index


def keys(tokens: list[int], **request: Any) -> list[int]:
    return request_keys(tokens, BLOCK, **request)


def test_a_stored_prompt_matches_its_prefixes_and_its_extensions() -> None:
    index = index_with(A)
    tokens = prompt(4, seed=1)
    index.apply(A, [stored(tokens, 100)])
    assert index.match(keys(tokens), 0) == {A: 16}
    assert index.match(keys(tokens[:9]), 0) == {A: 8}                  # the partial block: no key
    assert index.match(keys(tokens + prompt(2, seed=2)), 0) == {A: 16}
    assert index.match(keys(prompt(4, seed=3)), 0) == {}
    assert index.match([], 0) == {}


def test_each_slot_reports_its_own_depth() -> None:
    index = index_with(A, B, C)
    tokens = prompt(5, seed=1)
    index.apply(A, [stored(tokens[:8], 100)])                          # 2 blocks
    index.apply(B, [stored(tokens[:8], 200), stored(tokens, 202, parent=201, start=8)])
    index.apply(C, [stored(prompt(5, seed=9), 300)])
    assert index.match(keys(tokens), 0) == {A: 8, B: 20}


def test_extra_keys_from_an_event_match_the_same_request() -> None:
    """The engine's extra keys travel through msgpack (tuples become lists and back); the request
    side builds them from the media, LoRA name and salt: the keys must agree."""
    tokens = prompt(5, seed=4)
    request = {"media": [MediaFeature("img-a", 5, 7)], "lora_name": "sql", "cache_salt": "s"}
    event = stored(tokens, 100, extra_keys=extras_for(tokens, **request), lora_name="sql")
    index = index_with(A)
    index.apply(A, decode_batch(encode_batch([event])).events)
    assert index.match(keys(tokens, **request), 0) == {A: 20}
    assert index.match(keys(tokens), 0) == {}
    other_image = {**request, "media": [MediaFeature("img-b", 5, 7)]}
    assert index.match(keys(tokens, **other_image), 0) == {A: 4}       # block 0 has no image


def test_an_adapters_blocks_match_only_that_adapter_and_go_when_it_is_reloaded() -> None:
    """vLLM keys an adapter's blocks with its name (a bare string first in each block's extra
    keys, as its events carry it: llm-d-router #2927 read it as a media hash): a base prompt
    never matches them, nor another adapter's prompt. A reload under the same name (vllm
    #42125) drops them, and only them: the slot's base blocks and other adapters' stay."""
    tokens = prompt(3, seed=7)
    index = index_with(A)
    events = [stored(tokens, 100),
              stored(tokens, 200, extra_keys=extras_for(tokens, lora_name="sql"),
                     lora_name="sql"),
              stored(tokens, 300, extra_keys=extras_for(tokens, lora_name="chat"),
                     lora_name="chat")]
    index.apply(A, decode_batch(encode_batch(events)).events)
    assert index.match(keys(tokens, lora_name="sql"), 0) == {A: 12}
    assert index.match(keys(tokens, lora_name="chat"), 0) == {A: 12}
    assert index.match(keys(tokens), 0) == {A: 12}  # the base's own blocks
    assert index.match(keys(tokens, lora_name="other"), 0) == {}
    assert index.drop_adapter(A, "sql") == 3
    assert index.match(keys(tokens, lora_name="sql"), 0) == {}
    assert index.match(keys(tokens, lora_name="chat"), 0) == {A: 12}
    assert index.match(keys(tokens), 0) == {A: 12}
    assert index.drop_adapter(A, "sql") == 0 and index.drop_adapter(("nope", None), "chat") == 0
    # Removed and evicted blocks leave its list: a later drop finds nothing stale.
    index.apply(A, [BlockRemoved((300, 301, 302), "GPU")])
    assert index.drop_adapter(A, "chat") == 0


def test_a_block_whose_parent_is_unknown_is_not_indexed() -> None:
    """Taking it for a root would match prompts that merely start with the same tokens."""
    index = index_with(A)
    tokens = prompt(4, seed=1)
    index.apply(A, [stored(tokens, 102, parent=101, start=8)])
    assert index.match(keys(tokens[8:]), 0) == {}
    assert index.match(keys(tokens), 0) == {}
    assert index.stats(A).orphans == 2
    assert index.stats(A).entries == 0


def test_removed_blocks_and_a_cleared_cache() -> None:
    index = index_with(A)
    tokens = prompt(4, seed=1)
    index.apply(A, [stored(tokens, 100)])
    index.apply(A, [BlockRemoved((103,), "GPU"), BlockRemoved((999,), "GPU")])  # 999: unknown
    assert index.match(keys(tokens), 0) == {A: 12}
    index.apply(A, [AllBlocksCleared()])
    assert index.match(keys(tokens), 0) == {}
    stats = index.stats(A)
    assert (stats.stored, stats.removed, stats.cleared, stats.entries) == (4, 1, 1, 0)


SKIPPED = [
    # (the event's difference, why it is not indexed)
    ({"medium": "CPU"}, "an offloaded copy is not a GPU prefix hit"),
    ({"group_idx": 1}, "another KV cache group"),
    ({"block_size": 8}, "another block size"),
    ({"truncate": 3}, "tokens that do not cover the blocks"),
    ({"extra_keys": [None]}, "extra keys that are not one per block"),
]


@pytest.mark.parametrize(("change", "why"), SKIPPED)
def test_events_the_index_does_not_hold_are_skipped_and_counted(change: dict[str, Any],
                                                                why: str) -> None:
    index = index_with(A)
    tokens = prompt(4, seed=1)
    event = stored(tokens, 100, **{k: v for k, v in change.items() if k != "block_size"})
    if "block_size" in change:
        event.block_size = change["block_size"]
    if "truncate" in change:
        event.token_ids = event.token_ids[:-change["truncate"]]
    index.apply(A, [event])
    assert index.match(keys(tokens), 0) == {}, why
    assert index.stats(A).skipped == 1


@pytest.mark.parametrize("removed", [BlockRemoved((100,), "CPU"), BlockRemoved((100,), "GPU", 1)])
def test_a_removal_from_another_medium_or_group_leaves_the_gpu_block(removed: BlockRemoved) -> None:
    index = index_with(A)
    tokens = prompt(2, seed=1)
    index.apply(A, [stored(tokens, 100), removed])
    assert index.match(keys(tokens), 0) == {A: 8}
    assert index.stats(A).skipped == 1


def test_unknown_events_are_counted_and_the_rest_of_the_batch_applies() -> None:
    index = index_with(A)
    tokens = prompt(2, seed=1)
    index.apply(A, [UnknownEvent("CacheEviction"), stored(tokens, 100)])
    assert index.match(keys(tokens), 0) == {A: 8}
    assert (index.stats(A).unknown, index.stats(A).events) == (1, 2)


def test_the_cap_evicts_the_oldest_blocks_first() -> None:
    index = index_with(A, B, max_blocks_per_slot=6)
    first, second = prompt(4, seed=1), prompt(4, seed=2)
    index.apply(A, [stored(first, 100)])
    index.apply(A, [stored(second, 200)])
    index.apply(B, [stored(first, 300)])                               # B's own cap
    assert index.match(keys(first), 0) == {B: 16}                      # A lost first's root
    assert index.match(keys(second), 0) == {A: 16}
    assert (index.stats(A).evictions, index.stats(A).entries) == (2, 6)
    assert index.stats(B).evictions == 0


def test_the_same_block_stored_twice_is_held_once() -> None:
    index = index_with(A)
    tokens = prompt(2, seed=1)
    index.apply(A, [stored(tokens, 100), stored(tokens, 100)])
    assert index.stats(A).entries == 2
    index.apply(A, [BlockRemoved((100, 101), "GPU")])
    assert index.match(keys(tokens), 0) == {}


def test_only_exact_slots_report_matches() -> None:
    index = KvIndex(block_size=BLOCK, rebuild_window=10.0)
    tokens = prompt(3, seed=1)
    index.add_slot(A)
    index.apply(A, [stored(tokens, 100)])                              # before any seq: FALLBACK
    assert index.trust(A) is Trust.FALLBACK
    assert index.match(keys(tokens), 0) == {}
    index.fresh(A, 0)
    index.apply(A, [stored(tokens, 100)])
    assert index.trust(A) is Trust.EXACT and index.match(keys(tokens), 1) == {A: 12}


def test_a_degraded_slot_drops_its_entries_and_is_exact_again_after_the_rebuild_window() -> None:
    index = index_with(A, rebuild_window=10.0)
    old, new = prompt(3, seed=1), prompt(3, seed=2)
    index.apply(A, [stored(old, 100)])
    index.lost(A, now=100.0)
    assert index.trust(A) is Trust.DEGRADED and index.stats(A).entries == 0
    index.apply(A, [stored(new, 200), stored(old, 103, parent=102, start=8)])  # old's parent: gone
    assert index.match(keys(new), 105.0) == {}                        # degraded: holds nothing
    index.lost(A, now=105.0)                                           # a second loss: window anew
    index.apply(A, [stored(new, 200)])
    assert index.match(keys(new), 114.9) == {}
    assert index.match(keys(new), 115.0) == {A: 12}
    assert index.trust(A) is Trust.EXACT
    assert index.match(keys(old), 115.0) == {}                         # under-counts, never over
    assert index.stats(A).losses == 2


def test_fresh_resets_a_slot_and_makes_it_exact_at_once() -> None:
    """An engine restart: its cache is empty, and every event from its seq 0 will be seen."""
    index = index_with(A, rebuild_window=10.0)
    tokens = prompt(3, seed=1)
    index.apply(A, [stored(tokens, 100)])
    index.lost(A, 0.0)
    index.fresh(A, 1.0)
    assert index.trust(A) is Trust.EXACT and index.stats(A).entries == 0
    assert index.match(keys(tokens), 1.0) == {}


def test_speculation_holds_a_routed_prefix_until_it_expires_or_the_engine_reports_it() -> None:
    index = index_with(A, B, speculation_ttl=2.0)
    tokens, other = prompt(4, seed=1), prompt(4, seed=2)
    index.speculate(A, keys(tokens), now=10.0)
    index.speculate(B, keys(other), now=10.0)
    assert index.match(keys(tokens), 11.0) == {A: 16}
    assert index.stats(A).speculative == 4
    index.apply(A, [stored(tokens[:8], 100)])                          # the engine reports 2 blocks
    assert index.stats(A).speculative == 2
    assert index.match(keys(tokens), 12.0) == {A: 8}                   # expired: the real ones stay
    assert index.match(keys(other), 12.0) == {}
    assert (index.stats(A).speculative, index.stats(B).speculative) == (0, 0)


def test_speculation_is_renewed_and_removed_by_a_reset_or_a_dropped_slot() -> None:
    index = index_with(A, B, speculation_ttl=2.0)
    tokens = prompt(3, seed=1)
    index.speculate(A, keys(tokens), now=0.0)
    index.speculate(A, keys(tokens), now=1.5)                          # renewed: the first expiry
    assert index.match(keys(tokens), 2.5) == {A: 12}                   # does not remove it
    index.apply(A, [AllBlocksCleared()])
    assert index.match(keys(tokens), 2.5) == {}
    index.speculate(B, keys(tokens), now=3.0)
    index.drop_slot(B)
    index.add_slot(C)
    index.fresh(C, 3.0)                                                 # C takes B's bit
    assert index.match(keys(tokens), 3.5) == {}
    assert index.match(keys(tokens), 6.0) == {}                        # B's stale expiry: harmless


def test_speculation_on_a_slot_that_reports_nothing_is_ignored() -> None:
    index = KvIndex(block_size=BLOCK)
    index.add_slot(A)
    index.speculate(A, keys(prompt(2, seed=1)), now=0.0)
    index.speculate(("unknown", 0), keys(prompt(2, seed=1)), now=0.0)
    assert index.stats(A).speculative == 0


def test_dropping_a_slot_forgets_it_and_frees_its_bit() -> None:
    index = index_with(A, B)
    tokens = prompt(3, seed=1)
    index.apply(A, [stored(tokens, 100)])
    index.apply(B, [stored(tokens, 100)])
    index.drop_slot(A)
    index.drop_slot(A)                                                 # twice: nothing
    assert index.match(keys(tokens), 0) == {B: 12}
    index.add_slot(C)
    index.fresh(C, 0)
    assert index.match(keys(tokens), 0) == {B: 12}                     # C did not inherit A's bit
    assert index.slots() == [B, C]
    index.apply(A, [stored(tokens, 100)])                               # a late batch: ignored
    index.lost(A, 0)
    index.fresh(A, 0)
    assert A not in index.slots()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        KvIndex(block_size=0)
    with pytest.raises(ValueError, match="positive"):
        KvIndex(max_blocks_per_slot=0)
