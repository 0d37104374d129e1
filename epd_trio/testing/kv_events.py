"""vLLM's KV cache events as plain values, and their exact msgpack wire shapes (no I/O).

vLLM (``vllm/distributed/kv_events.py``) defines ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared`` as tagged msgspec structs inside an ``EventBatch`` ``[ts, [events],
data_parallel_rank]`` (the batch stayed ``array_like`` when the events changed shape). Two event
shapes exist on the wire, and a consumer has to read both during a fleet's upgrade:

- ``"map"`` (vLLM PR #42892, May 2026, the shape real vLLM 0.32 sends): a map whose ``"type"``
  is the tag, fields in declaration order, and (``omit_defaults``) the optional trailing fields
  left out while they hold their default ``None``.
- ``"array"`` (before that): ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window]``, every field written: msgspec ignores ``omit_defaults`` for
  ``array_like`` structs (msgspec issue #720). ``BlockRemoved`` is ``[tag, block_hashes,
  medium, group_idx]``, ``AllBlocksCleared`` is ``[tag]``.

The field order is the order vLLM added them (#16750, #19737, #27577, #33304, #37688, #40984,
as listed in #42892). Block hashes are what vLLM sends with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
(its default): the low 64 bits of the hash, an unsigned int.

Events are kept as dataclasses until a socket needs bytes, so an in-process consumer (the bench
feeding an index) pays no encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

#: The two event shapes: tagged maps (vLLM since PR #42892) or the older tagged arrays.
Shape = Literal["map", "array"]
SHAPES: tuple[Shape, ...] = ("map", "array")
#: vLLM writes "GPU" as the medium of its own KV cache, even on the CPU backend.
MEDIUM_GPU = "GPU"
#: ``KVCacheSpecKind.FULL_ATTENTION``: the one cache group of a plain decoder model.
FULL_ATTENTION = "full_attention"
#: One extra-keys entry per block: None, or a tuple (multimodal keys, LoRA name, cache salt).
ExtraKeys = tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly cached, in chain order; ``parent_block_hash`` precedes the first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    #: Every token of those blocks (``len(block_hashes) * block_size`` of them).
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    #: One entry per block (vLLM sends ``[None, ...]`` for a text-only prompt).
    extra_keys: list[ExtraKeys] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = FULL_ATTENTION
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was dropped (``/reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
#: Where a cache's events go, one call per engine step: ``sink(dp_rank, events)``. The
#: publisher's ``publish`` is one; the bench can pass its index's method instead.
EventSink = Callable[[int, Sequence[KVEvent]], object]

_STORED_OPTIONAL = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def event_wire(event: KVEvent, shape: Shape = "map") -> Any:
    """One event as vLLM's msgspec encoder lays it out (before msgpack)."""
    if isinstance(event, BlockStored):
        head = [event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.lora_id, event.medium, event.lora_name]
        tail = [event.extra_keys, event.group_idx, event.kv_cache_spec_kind,
                event.kv_cache_spec_sliding_window]
        if shape == "array":
            return ["BlockStored", *head, *tail]
        out: dict[str, Any] = {"type": "BlockStored", "block_hashes": head[0],
                               "parent_block_hash": head[1], "token_ids": head[2],
                               "block_size": head[3], "lora_id": head[4], "medium": head[5],
                               "lora_name": head[6]}
        out.update((k, v) for k, v in zip(_STORED_OPTIONAL, tail, strict=True) if v is not None)
        return out
    if isinstance(event, BlockRemoved):
        if shape == "array":
            return ["BlockRemoved", event.block_hashes, event.medium, event.group_idx]
        out = {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return ["AllBlocksCleared"] if shape == "array" else {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[KVEvent], dp_rank: int, shape: Shape = "map") -> bytes:
    """The third frame of a published message: msgpack ``[ts, [events], dp_rank]``."""
    return msgpack.packb([ts, [event_wire(e, shape) for e in events], dp_rank])


def sequence_frame(seq: int) -> bytes:
    """The second frame: the batch's sequence number, 8 bytes big-endian."""
    return seq.to_bytes(8, "big")


#: The replay socket's end marker (``ZmqEventPublisher.END_SEQ``): -1 as 8 signed bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
