"""The KV event publisher sends vLLM's frames, replays like vLLM, and breaks on request."""

from __future__ import annotations

import msgpack
import pytest
import trio
import zmq

from epd_trio._kv.wire import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    encode_event,
)
from epd_trio.testing.kv_publisher import KVEventPublisher
from epd_trio.testing.zmq_peer import ZmqPeer, subscriber

STORED = BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=[1] * 64,
                     block_size=32, extra_keys=[None, (("img", 3),)], medium="GPU", group_idx=0)


def test_event_shapes_are_vllms() -> None:
    stored = encode_event(STORED)
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                            "kv_cache_spec_kind"]  # the None sliding window is omitted
    assert stored["type"] == "BlockStored" and stored["medium"] == "GPU"
    assert encode_event(STORED, positional=True) == [
        "BlockStored", [2**64 - 1, 7], None, [1] * 64, 32, None, "GPU", None,
        [None, (("img", 3),)], 0, "full_attention", None]
    assert encode_event(BlockRemoved([5], "GPU", 0)) == {"type": "BlockRemoved", "block_hashes": [5],
                                                         "medium": "GPU", "group_idx": 0}
    assert encode_event(BlockRemoved([5], "GPU", 0), positional=True) == ["BlockRemoved", [5], "GPU", 0]
    assert encode_event(AllBlocksCleared()) == {"type": "AllBlocksCleared"}
    assert encode_event(AllBlocksCleared(), positional=True) == ["AllBlocksCleared"]
    batch = msgpack.unpackb(encode_batch([STORED], ts=1.5, dp_rank=3))
    assert batch[0] == 1.5 and batch[2] == 3 and batch[1][0]["extra_keys"] == [None, [["img", 3]]]


@pytest.mark.parametrize("shape", ["map", "array"])
async def test_a_subscriber_gets_vllms_frames_per_rank(nursery: trio.Nursery, shape: str) -> None:
    publisher = KVEventPublisher(dp_size=2, topic="kv", positional=shape == "array")
    endpoints = await nursery.start(publisher.run)
    ports = [int(url.rsplit(":", 1)[1]) for url in endpoints.publish]
    assert ports[1] == ports[0] + 1  # rank r on base + r, like vLLM's offset_endpoint_port
    assert endpoints.replay is not None
    assert int(endpoints.replay[1].rsplit(":", 1)[1]) == int(endpoints.replay[0].rsplit(":", 1)[1]) + 1
    with subscriber(endpoints.publish[1]) as sub:
        await publisher.wait_subscribed(1)
        for _ in range(3):
            publisher.publish(1, [STORED, BlockRemoved([7], "GPU", 0)])
        with trio.fail_after(5):
            messages = [await sub.receive() for _ in range(3)]
    for seq, frames in enumerate(messages):
        topic, seq_bytes, payload = frames
        assert topic == b"kv" and len(seq_bytes) == 8 and int.from_bytes(seq_bytes, "big") == seq
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 1
        if shape == "map":
            assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved"]
            assert events[0]["block_hashes"] == [2**64 - 1, 7]
        else:
            assert [e[0] for e in events] == ["BlockStored", "BlockRemoved"]
            assert events[0][1] == [2**64 - 1, 7] and len(events[0]) == 12
    assert publisher.next_seq(0) == 0  # ranks count separately


async def test_replay_fills_a_dropped_batch_and_ends_with_the_marker(nursery: trio.Nursery) -> None:
    publisher = KVEventPublisher(buffer_steps=3)
    endpoints = await nursery.start(publisher.run)
    assert endpoints.replay is not None
    with subscriber(endpoints.publish[0]) as sub, ZmqPeer(zmq.DEALER, endpoints.replay[0]) as dealer:
        await publisher.wait_subscribed()
        publisher.publish(0, [STORED])
        publisher.drop_next()
        publisher.publish(0, [BlockRemoved([7], "GPU", 0)])
        publisher.publish(0, [AllBlocksCleared()])
        with trio.fail_after(5):
            seqs = [int.from_bytes((await sub.receive())[1], "big") for _ in range(2)]
        assert seqs == [0, 2]  # the gap a consumer must fill
        dealer.send([b"", (1).to_bytes(8, "big")])
        with trio.fail_after(5):
            replies = await dealer.receive_until_end()
        # vLLM 0.32's shape (seen on the real server): the topic before each seq.
        assert [r[:3] for r in replies] == [[b"", b"kv", (1).to_bytes(8, "big")],
                                            [b"", b"kv", (2).to_bytes(8, "big")],
                                            [b"", b"", END_OF_REPLAY]]
        assert replies[-1] == [b"", b"", END_OF_REPLAY, b""]
        assert msgpack.unpackb(replies[0][3])[1] == [encode_event(BlockRemoved([7], "GPU", 0))]
        # The buffer keeps the last three batches only: a gap older than that cannot be filled.
        publisher.publish(0, [AllBlocksCleared()])
        dealer.send([b"", (0).to_bytes(8, "big")])
        with trio.fail_after(5):
            replies = await dealer.receive_until_end()
        assert [int.from_bytes(r[2], "big", signed=True) for r in replies] == [1, 2, 3, -1]
        # A request in the wrong shape gets no answer (vLLM logs it and moves on).
        dealer.send([b"", b"\x00", b"extra"])
        dealer.send([b"", (3).to_bytes(8, "big")])
        with trio.fail_after(5):
            replies = await dealer.receive_until_end()
        assert [int.from_bytes(r[2], "big", signed=True) for r in replies] == [3, -1]


async def test_restart_and_malformed_frames(nursery: trio.Nursery) -> None:
    publisher = KVEventPublisher()
    endpoints = await nursery.start(publisher.run)
    with subscriber(endpoints.publish[0]) as sub:
        await publisher.wait_subscribed()
        publisher.publish(0, [STORED])
        publisher.send_malformed()
        publisher.restart(clear=True)
        publisher.publish(0, [STORED])
        with trio.fail_after(5):
            received = [await sub.receive() for _ in range(4)]
    assert [int.from_bytes(f[1], "big") for f in received] == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        msgpack.unpackb(received[1][2])
    assert msgpack.unpackb(received[2][2])[1] == [{"type": "AllBlocksCleared"}]


async def test_fixed_ports_are_offset_per_rank(nursery: trio.Nursery) -> None:
    first = KVEventPublisher(dp_size=2, replay_port=None)
    taken = await nursery.start(first.run)
    base = int(taken.publish[0].rsplit(":", 1)[1])
    with pytest.raises(OSError, match="cannot bind"):
        await nursery.start(KVEventPublisher(port=base + 1).run)
    assert taken.replay is None
