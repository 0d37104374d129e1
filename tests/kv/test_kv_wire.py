"""The KV event wire format: both vLLM shapes decoded, anything else refused with one error."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_trio._kv.wire import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedKvMessage,
    UnknownEvent,
    decode_batch,
    decode_replay_reply,
    encode_batch,
    encode_message,
    encode_replay_request,
    split_message,
)

TOKENS = list(range(8))
#: A BlockStored as vLLM 0.32 writes it (a tagged map, every field present).
STORED_MAP = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "GPU",
              "lora_name": None, "extra_keys": [None, ["lora-a", ["mm1", -2]]], "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
STORED = BlockStored((11, 12), None, tuple(TOKENS), 4, (None, ("lora-a", ("mm1", -2))), None,
                     "GPU", 0)

DECODED = [
    # (what vLLM wrote, the events read)
    ([1.5, [STORED_MAP], 0], (STORED,)),
    ([1.5, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"}], 3],
     (BlockRemoved((b"\x01" * 32,), "GPU", None),)),
    ([1.5, [{"type": "AllBlocksCleared"}]], (AllBlocksCleared(),)),
    # The positional shape before May 2026, from its first release (no medium) to the last.
    ([1.5, [["BlockStored", [11, 12], None, TOKENS, 4, None]], 0],
     (BlockStored((11, 12), None, tuple(TOKENS), 4),)),
    ([1.5, [["BlockStored", [11, 12], 7, TOKENS, 4, None, "GPU", "lora-a"]]],
     (BlockStored((11, 12), 7, tuple(TOKENS), 4, None, "lora-a", "GPU"),)),
    ([1.5, [["BlockStored", [11, 12], None, TOKENS, 4, None, "GPU", None,
             [None, ["lora-a", ["mm1", -2]]], 0, "full_attention"]]], (STORED,)),
    ([1.5, [["BlockRemoved", [11], "GPU"], ["BlockRemoved", [12]], ["AllBlocksCleared"]]],
     (BlockRemoved((11,), "GPU"), BlockRemoved((12,)), AllBlocksCleared())),
    # A newer vLLM's event types are kept as unknown (skipped and counted by the index).
    ([1.5, [{"type": "CacheEviction", "x": 1}, ["TransferCompleted", 1, 2]], 0],
     (UnknownEvent("CacheEviction"), UnknownEvent("TransferCompleted"))),
    # The batch as a map: msgspec writes one when EventBatch is not array-like.
    ({"ts": 1.5, "events": [STORED_MAP], "data_parallel_rank": 2}, (STORED,)),
]


@pytest.mark.parametrize(("written", "events"), DECODED)
def test_both_vllm_shapes_decode_to_the_same_events(written: Any, events: tuple[Any, ...]) -> None:
    batch = decode_batch(msgpack.packb(written))
    assert batch.events == events
    assert batch.ts == 1.5


def test_dp_rank_is_read_when_present() -> None:
    assert decode_batch(msgpack.packb([0, [], 3])).dp_rank == 3
    assert decode_batch(msgpack.packb([0, []])).dp_rank is None
    assert decode_batch(msgpack.packb([0, [], None])).dp_rank is None


@pytest.mark.parametrize("positional", [False, True])
def test_encoding_round_trips(positional: bool) -> None:
    events = (STORED, BlockRemoved((11, 12), "GPU", 0), AllBlocksCleared(), UnknownEvent("New"))
    payload = encode_batch(events, ts=2.0, dp_rank=1, positional=positional)
    assert decode_batch(payload) == EventBatch(2.0, events, 1)
    if not positional:  # the map shape carries every field vLLM 0.32 writes
        assert msgpack.unpackb(payload)[1][0] == STORED_MAP


MALFORMED = [
    b"",
    b"\xc1",                                   # a byte msgpack never uses
    msgpack.packb([0, []]) + b"\x00",          # trailing bytes
    msgpack.packb("a batch"),
    msgpack.packb([0]),
    msgpack.packb([0, [], 0, 1]),
    msgpack.packb(["ts", []]),
    msgpack.packb([0, {"events": 1}]),
    msgpack.packb([0, [], "rank"]),
    msgpack.packb([0, [7]]),
    msgpack.packb([0, [[]]]),
    msgpack.packb([0, [[7, 1]]]),
    msgpack.packb([0, [{"block_hashes": [1]}]]),              # no type
    msgpack.packb([0, [{"type": 5}]]),
    msgpack.packb([0, [{"type": {"a": 1}}]]),
    msgpack.packb([0, [["BlockStored", [1], None, TOKENS]]]),   # too short
    msgpack.packb([0, [["BlockRemoved"]]]),
    msgpack.packb([0, [{**STORED_MAP, "block_size": "4"}]]),
    msgpack.packb([0, [{**STORED_MAP, "token_ids": [1, {"a": 1}, 3, 4]}]]),
    msgpack.packb([0, [{**STORED_MAP, "token_ids": 5}]]),
    msgpack.packb([0, [{**STORED_MAP, "block_hashes": [{"a": 1}]}]]),
    msgpack.packb([0, [{**STORED_MAP, "block_hashes": None}]]),
    msgpack.packb([0, [{**STORED_MAP, "parent_block_hash": {"a": 1}}]]),
    msgpack.packb([0, [{**STORED_MAP, "extra_keys": "x"}]]),
    msgpack.packb([0, [{**STORED_MAP, "medium": 1}]]),
    msgpack.packb([0, [{**STORED_MAP, "lora_name": 1}]]),
    msgpack.packb([0, [{**STORED_MAP, "group_idx": "0"}]]),
    msgpack.packb([0, [{"type": "BlockRemoved", "block_hashes": 3}]]),
    msgpack.packb([0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": 1.0}]]),
    b"\xa2\xff\xfe",                           # a str that is not UTF-8
]


@pytest.mark.parametrize("payload", MALFORMED)
def test_anything_not_vllms_shape_is_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedKvMessage):
        decode_batch(payload)


FRAMES = [
    ([b"kv", (5).to_bytes(8, "big"), b"payload"], (b"kv", 5, b"payload")),
    ([b"", (2**64 - 2).to_bytes(8, "big"), b""], (b"", 2**64 - 2, b"")),
]


@pytest.mark.parametrize(("frames", "split"), FRAMES)
def test_a_message_splits_into_topic_seq_and_payload(frames: list[bytes], split: Any) -> None:
    assert split_message(frames) == split


@pytest.mark.parametrize("frames", [[], [b"kv", b"\x00" * 8], [b"kv", b"\x00" * 7, b"p"],
                                    [b"kv", b"\x00" * 9, b"p"], [b"a", b"b", b"c", b"d"]])
def test_frames_not_topic_seq_payload_are_malformed(frames: list[bytes]) -> None:
    with pytest.raises(MalformedKvMessage):
        split_message(frames)


REPLIES = [
    # vLLM 0.32 (ZmqEventPublisher._service_replay, seen on the real server): the topic too.
    ([b"", b"kv", (3).to_bytes(8, "big"), b"payload"], (3, b"payload")),
    ([b"", b"", END_OF_REPLAY, b""], None),
    # Earlier vLLM: no topic.
    ([b"", (3).to_bytes(8, "big"), b"payload"], (3, b"payload")),
    ([b"", END_OF_REPLAY, b""], None),
]


@pytest.mark.parametrize(("frames", "reply"), REPLIES)
def test_replay_replies(frames: list[bytes], reply: Any) -> None:
    assert decode_replay_reply(frames) == reply


@pytest.mark.parametrize("frames", [[(3).to_bytes(8, "big"), b"p"], [b"x", END_OF_REPLAY, b""],
                                    [b"", b"\x01", b"p"], [b"x", b"kv", END_OF_REPLAY, b""],
                                    [b"", b"kv", b"\x01", b"p"],
                                    [b"", b"a", b"b", b"c", b"d"]])
def test_replay_replies_not_vllms_shape_are_malformed(frames: list[bytes]) -> None:
    with pytest.raises(MalformedKvMessage):
        decode_replay_reply(frames)


def test_the_frames_sent_are_vllms() -> None:
    # ZmqEventPublisher: seq.to_bytes(8, "big"); its ROUTER reads [identity, b"", start_seq].
    assert encode_message(b"kv", 258, b"p") == [b"kv", b"\x00" * 6 + b"\x01\x02", b"p"]
    assert encode_replay_request(0) == [b"", b"\x00" * 8]
    assert END_OF_REPLAY == b"\xff" * 8


# --- any input: a typed error or a batch, never another exception ------------------------------

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=12)
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
FIELDS = st.sampled_from(list(STORED_MAP))
EVENTS = (st.builds(lambda tag, fields: {**fields, "type": tag}, TAGS,
                    st.dictionaries(FIELDS, VALUES, max_size=6))
          | st.builds(lambda tag, values: [tag, *values], TAGS, st.lists(VALUES, max_size=11))
          | st.builds(lambda tag, index, value: {**STORED_MAP, "type": tag, index: value}, TAGS,
                      FIELDS, VALUES)
          | VALUES)
BATCHES = st.builds(lambda ts, events, rank: [ts, events, rank], VALUES, st.lists(EVENTS, max_size=4),
                    VALUES) | VALUES


def _decodes_or_refuses(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except MalformedKvMessage:
        return
    assert isinstance(batch, EventBatch)
    for event in batch.events:
        if isinstance(event, BlockStored):
            hash((event.block_hashes, event.parent_block_hash, event.token_ids))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_another_exception(payload: bytes) -> None:
    _decodes_or_refuses(payload)


@settings(max_examples=150, deadline=None)
@given(BATCHES)
def test_random_msgpack_never_raises_another_exception(batch: Any) -> None:
    _decodes_or_refuses(msgpack.packb(batch))

