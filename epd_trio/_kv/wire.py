"""vLLM's KV cache event messages: frames in, typed events out (and back, for the fakes and tests).

A message on vLLM's PUB socket (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) is three
frames: the topic, the sequence number as 8 bytes big-endian, and a msgpack ``EventBatch``. vLLM
0.32 writes the batch as ``[ts, events, dp_rank]`` and each event as a map tagged by ``"type"``
(``{"type": "BlockStored", "block_hashes": [...], ...}``). Before May 2026 the events were
msgspec ``array_like`` structs, positional with the tag first: ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
...]``, ``["BlockRemoved", block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``; the first
releases had fewer fields. Both are read; a batch written as a map (``{"ts", "events",
"data_parallel_rank"}``) too, since msgspec writes one when the struct is not array-like.

The replay socket (a ROUTER) takes ``[b"", start_seq]`` from a DEALER and answers one message
per buffered batch with ``seq >= start_seq``, then an end marker whose seq is -1. vLLM 0.32 sends
``[b"", topic, seq, payload]`` and ``[b"", b"", -1, b""]`` (checked against the real server:
tests/e2e_vllm/test_real_kv_routing.py); earlier versions ``[b"", seq, payload]`` and
``[b"", -1, b""]``. Both are read.

Only the shape is checked here: field types, and that ids and tokens hash (what the index needs
of them; a float token passes and matches nothing). Not what the fields mean together (a
BlockStored whose tokens do not cover its blocks is the index's business): a message refused
here is a message lost. An event whose tag is unknown becomes ``UnknownEvent`` (skipped and
counted by the index); anything else that is not vLLM's shape raises ``MalformedKvMessage``, and
nothing else: ``decode_*`` never raise another exception on any input.

Writing (``encode_*``) is msgspec's layout of vLLM's structs, for the fake vLLM
(``epd_trio.testing``) and the tests: in a map a field with a default (``extra_keys``,
``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) is left out while it
holds None (``omit_defaults``); a positional event has every field, since msgspec ignores
``omit_defaults`` for ``array_like`` structs (msgspec issue #720). What this module has no field
for is written as a plain decoder model's engine writes it: ``lora_id`` None (deprecated),
``kv_cache_spec_kind`` ``"full_attention"``, no sliding window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

#: vLLM's block hash as published: sha256 bytes, or a 64-bit int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
BlockHash = int | bytes
#: One block's extra keys: None, or what vLLM hashed with its tokens (media, LoRA name, salt).
ExtraKeys = tuple[Any, ...] | None
#: The replay socket's end-of-replay sequence number, as vLLM sends it (8 bytes, signed).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
#: The medium vLLM names its own KV cache by (``MEDIUM_GPU``), even on the CPU backend.
MEDIUM_GPU = "GPU"
#: ``kv_cache_spec_kind`` of the one cache group of a plain decoder model.
FULL_ATTENTION = "full_attention"


class MalformedKvMessage(ValueError):
    """A message (or replay reply) that is not vLLM's shape: counted and dropped by the caller."""


@dataclass(slots=True)
class BlockStored:
    """Full blocks the engine cached, in chain order: block i's parent is block i-1, block 0's is
    ``parent_block_hash`` (None: a prompt's first block). ``token_ids`` covers all of them;
    ``extra_keys`` has one entry per block (None, or the media/LoRA/salt keys vLLM hashed).
    Decoded, the sequences are tuples; a fake may build one with lists."""

    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    extra_keys: Sequence[ExtraKeys] | None = None
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: Sequence[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``/reset_prefix_cache``)."""


@dataclass(slots=True)
class UnknownEvent:
    """An event type this module does not know (a newer vLLM's): skipped, counted by ``tag``."""

    tag: str


# The event classes are plain slotted dataclasses, read-only by convention: a frozen one costs
# about ten times as much to build, and ingestion builds one per event.
KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(slots=True)
class EventBatch:
    """One published batch: the events of one engine step."""

    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


def split_message(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a PUB message, without decoding the payload (a duplicate is
    skipped before paying for that)."""
    if len(frames) != 3:
        raise MalformedKvMessage(f"a KV event message has 3 frames, not {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), decode_seq(seq), bytes(payload)


def decode_seq(frame: bytes) -> int:
    """An 8-byte big-endian unsigned sequence number."""
    if len(frame) != 8:
        raise MalformedKvMessage(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One replay reply as a DEALER receives it: ``(seq, payload)``, or None for the end marker.

    ``[b"", topic, seq, payload]`` (vLLM 0.32) or ``[b"", seq, payload]`` (earlier)."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise MalformedKvMessage("a replay reply is [b'', topic, seq, payload] or "
                                 f"[b'', seq, payload], not {len(frames)} frames")
    seq, payload = frames[-2], frames[-1]
    if seq == END_OF_REPLAY:
        return None
    return decode_seq(seq), bytes(payload)


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack ``EventBatch`` payload -> typed events (both vLLM shapes)."""
    try:
        raw = msgpack.unpackb(payload, use_list=False, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise MalformedKvMessage(f"the payload is not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, tuple) and len(raw) in (2, 3):
        ts, events, rank = raw[0], raw[1], (raw[2] if len(raw) == 3 else None)
    else:
        raise MalformedKvMessage("a batch is [ts, events, dp_rank] or a map")
    if not isinstance(ts, int | float) or not isinstance(events, tuple):
        raise MalformedKvMessage("a batch's ts is a number and its events a list")
    if rank is not None and type(rank) is not int:
        raise MalformedKvMessage("a batch's dp_rank is an int or nil")
    return EventBatch(float(ts), tuple(_event(raw_event) for raw_event in events), rank)


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = _MAP_READERS.get(tag) if isinstance(tag, str) else None
        if fields is None:
            return _unknown(tag)
        return fields(raw)
    if isinstance(raw, tuple) and raw and isinstance(raw[0], str):
        reader = _ARRAY_READERS.get(raw[0])
        return reader(raw) if reader is not None else UnknownEvent(raw[0])
    raise MalformedKvMessage("an event is a tagged map or a tagged array")


def _unknown(tag: object) -> UnknownEvent:
    if not isinstance(tag, str):
        raise MalformedKvMessage("an event map has a string 'type'")
    return UnknownEvent(tag)


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, medium: Any, lora_name: Any,
            extra_keys: Any, group_idx: Any) -> BlockStored:
    if (type(block_size) is not int or type(tokens) is not tuple or type(hashes) is not tuple
            or (extra_keys is not None and type(extra_keys) is not tuple)
            or (medium is not None and type(medium) is not str)
            or (lora_name is not None and type(lora_name) is not str)
            or (group_idx is not None and type(group_idx) is not int)):
        raise MalformedKvMessage("a BlockStored field has the wrong type")
    try:
        # What the index needs of ids and tokens is that they hash (a map inside would not):
        # one C-level pass each, cheaper than checking every token's type.
        hash((hashes, parent, tokens))
    except TypeError:
        raise MalformedKvMessage("BlockStored hashes and tokens are ints or bytes") from None
    return BlockStored(hashes, parent, tokens, block_size, extra_keys, lora_name, medium, group_idx)


def _removed(hashes: Any, medium: Any, group_idx: Any) -> BlockRemoved:
    if (type(hashes) is not tuple or (medium is not None and type(medium) is not str)
            or (group_idx is not None and type(group_idx) is not int)):
        raise MalformedKvMessage("a BlockRemoved field has the wrong type")
    try:
        hash(hashes)
    except TypeError:
        raise MalformedKvMessage("BlockRemoved hashes are ints or bytes") from None
    return BlockRemoved(hashes, medium, group_idx)


def _arg(raw: tuple[Any, ...], index: int) -> Any:
    return raw[index] if index < len(raw) else None


def _stored_from_array(raw: tuple[Any, ...]) -> BlockStored:
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
    #  extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]; the first
    # releases stopped at lora_id.
    if len(raw) < 5:
        raise MalformedKvMessage("a positional BlockStored has at least 5 fields")
    return _stored(raw[1], raw[2], raw[3], raw[4], _arg(raw, 6), _arg(raw, 7), _arg(raw, 8),
                   _arg(raw, 9))


def _removed_from_array(raw: tuple[Any, ...]) -> BlockRemoved:
    if len(raw) < 2:
        raise MalformedKvMessage("a positional BlockRemoved has its block_hashes")
    return _removed(raw[1], _arg(raw, 2), _arg(raw, 3))


def _cleared_from_array(raw: tuple[Any, ...]) -> AllBlocksCleared:
    return AllBlocksCleared()


def _stored_from_map(raw: dict[str, Any]) -> BlockStored:
    return _stored(raw.get("block_hashes"), raw.get("parent_block_hash"), raw.get("token_ids"),
                   raw.get("block_size"), raw.get("medium"), raw.get("lora_name"),
                   raw.get("extra_keys"), raw.get("group_idx"))


def _removed_from_map(raw: dict[str, Any]) -> BlockRemoved:
    return _removed(raw.get("block_hashes"), raw.get("medium"), raw.get("group_idx"))


def _cleared_from_map(raw: dict[str, Any]) -> AllBlocksCleared:
    return AllBlocksCleared()


_ARRAY_READERS = {"BlockStored": _stored_from_array, "BlockRemoved": _removed_from_array,
                  "AllBlocksCleared": _cleared_from_array}
_MAP_READERS = {"BlockStored": _stored_from_map, "BlockRemoved": _removed_from_map,
                "AllBlocksCleared": _cleared_from_map}


# --- writing, as vLLM does: for the fake vLLM publisher and the tests ---------------------------


def encode_event(event: KvEvent, *, positional: bool = False) -> Any:
    """One event as vLLM 0.32 writes it (a tagged map), or as before May 2026 (``positional``),
    before msgpack."""
    if isinstance(event, BlockStored):
        extra_keys = None if event.extra_keys is None else list(event.extra_keys)
        if positional:
            return ["BlockStored", list(event.block_hashes), event.parent_block_hash,
                    list(event.token_ids), event.block_size, None, event.medium, event.lora_name,
                    extra_keys, event.group_idx, FULL_ATTENTION, None]
        stored: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
            "block_size": event.block_size, "lora_id": None, "medium": event.medium,
            "lora_name": event.lora_name}
        if extra_keys is not None:
            stored["extra_keys"] = extra_keys
        if event.group_idx is not None:
            stored["group_idx"] = event.group_idx
        stored["kv_cache_spec_kind"] = FULL_ATTENTION
        return stored
    if isinstance(event, BlockRemoved):
        if positional:
            return ["BlockRemoved", list(event.block_hashes), event.medium, event.group_idx]
        removed: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                                   "medium": event.medium}
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    tag = "AllBlocksCleared" if isinstance(event, AllBlocksCleared) else event.tag
    return [tag] if positional else {"type": tag}


def encode_batch(events: Sequence[KvEvent], *, ts: float = 0.0, dp_rank: int | None = 0,
                 positional: bool = False) -> bytes:
    """A batch payload, the third frame of a message: ``[ts, events, dp_rank]`` in msgpack."""
    return msgpack.packb([ts, [encode_event(e, positional=positional) for e in events], dp_rank])


def encode_seq(seq: int) -> bytes:
    """A sequence number as vLLM sends it: 8 bytes big-endian."""
    return seq.to_bytes(8, "big")


def encode_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one PUB message."""
    return [topic, encode_seq(seq), payload]


def encode_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay ROUTER: an empty delimiter, then the first seq wanted."""
    return [b"", encode_seq(start_seq)]
