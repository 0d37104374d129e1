"""The pure half of the MoRIIO connector (``_core/moriio.py``) and its roster rules."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from epd_trio._core.errors import MalformedRegistration, RegistrationRefused
from epd_trio._core.moriio import (
    MAX_FRAME_BYTES,
    MoriioPeer,
    decode_kv_params,
    moriio_request_id,
    new_transfer_id,
    parse_frames,
    parse_zmq_address,
    prefill_kv_params,
)
from epd_trio._core.roster import Roster, register_moriio, silent_moriio
from epd_trio.testing.moriio import peer_addresses

COUNTERS = {"encode": 0, "prefill": 0, "decode": 0}
ZMQ_P = "host:10.0.0.1,handshake:6301,notify:61005"
ZMQ_D = "host:10.0.0.2,handshake:6302,notify:61006"


def payload(**changes: Any) -> dict[str, Any]:
    base = {"type": "P", "http_address": "10.0.0.1:8100", "zmq_address": ZMQ_P, "dp_size": 2,
            "tp_size": 1, "transfer_mode": "READ"}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def frames(data: Any) -> list[bytes]:
    return [b"identity", msgpack.packb(data)]


def test_a_registration_frame_as_the_connector_sends_it() -> None:
    reg = parse_frames(frames(payload()))
    assert reg is not None
    assert (reg.role, reg.instance.url, reg.instance.dp_size) == ("prefill", "http://10.0.0.1:8100", 2)
    assert reg.peer == MoriioPeer(ZMQ_P, 2, 1)
    assert reg.transfer_mode == "READ"
    decode = parse_frames(frames(payload(type="D", transfer_mode="WRITE", tp_size=4)))
    assert decode is not None and (decode.role, decode.peer.tp_size) == ("decode", 4)


def test_hello_is_a_no_op() -> None:
    assert parse_frames(frames({"type": "HELLO"})) is None


@pytest.mark.parametrize(("message", "reason"), [
    ([b"id"], "one payload frame"),
    ([b"id", b"a", b"b"], "one payload frame"),
    ([b"id", b"\xc1\xc1"], "not msgpack"),
    ([b"id", b"x" * (MAX_FRAME_BYTES + 1)], "bytes"),
    (frames([1, 2]), "not a map"),
    (frames({"type": "X"}), "unknown type"),
    (frames({"type": 5}), "unknown type"),
    (frames(payload(zmq_address=...)), "missing zmq_address"),
    (frames(payload(dp_size=0)), "dp_size"),
    (frames(payload(dp_size=True)), "dp_size"),
    (frames(payload(dp_size="2")), "dp_size"),
    (frames(payload(tp_size=10**6)), "tp_size"),
    (frames(payload(transfer_mode="read")), "transfer_mode"),
    (frames(payload(http_address="http://10.0.0.1:8100")), "http_address"),
    (frames(payload(http_address="10.0.0.1")), "http_address"),
    (frames(payload(http_address=8100)), "http_address"),
    # Issue 31: each once made an instance whose URL killed the prober.
    (frames(payload(http_address="user:pw@10.0.0.1:8100")), "http_address"),
    (frames(payload(http_address="10.0.0.1:\uff18\uff11")), "http_address"),
    (frames(payload(http_address="10.0.0.1 :8100")), "http_address"),
    (frames(payload(http_address="10.0.0.1:8100#x")), "http_address"),
    (frames(payload(http_address="10.0.0.1:99999")), "http_address"),
    (frames(payload(http_address="10.0.0.1:0")), "http_address"),
    (frames(payload(zmq_address="10.0.0.1:6301")), "zmq_address"),
    (frames(payload(zmq_address="host:a,handshake:x,notify:1")), "zmq_address"),
    (frames(payload(zmq_address="host:a___b,handshake:1,notify:2")), "zmq_address"),
    (frames(payload(zmq_address=["x"])), "zmq_address"),
])
def test_malformed_frames_are_refused_with_a_reason(message: list[bytes], reason: str) -> None:
    with pytest.raises(MalformedRegistration, match=reason):
        parse_frames(message)


def test_zmq_addresses_parse_as_the_connector_parses_them() -> None:
    assert parse_zmq_address(ZMQ_P) == ("10.0.0.1", 6301, 61005)
    assert parse_zmq_address("host:::1,handshake:1,notify:2") == ("::1", 1, 2)  # IPv6


@pytest.mark.parametrize("wrap", ["{}", "chatcmpl-{}", "cmpl-{}-0", "chatcmpl-{}-ab12cd34",
                                  "cmpl-{}-0-ab12cd34"])
def test_the_request_id_gives_each_side_its_peer_through_vllms_wrapping(wrap: str) -> None:
    for p, d in ((ZMQ_P, ZMQ_D), ("host:::1,handshake:1,notify:2", "host:fe80::1,handshake:3,notify:4")):
        rid = moriio_request_id(MoriioPeer(p), MoriioPeer(d))
        assert rid.startswith(f"___prefill_addr_{p}___decode_addr_{d}_")
        tail = rid.rsplit("_", 1)[1]
        assert len(tail) == 32 and all(c in "0123456789abcdef" for c in tail)
        assert peer_addresses(wrap.format(rid)) == (p, d)


def test_the_request_id_is_fresh_per_call_and_transfer_ids_look_like_upstreams() -> None:
    peers = MoriioPeer(ZMQ_P), MoriioPeer(ZMQ_D)
    assert moriio_request_id(*peers) != moriio_request_id(*peers)
    tid = new_transfer_id()
    assert tid.startswith("tx-") and len(tid) == 3 + 36 and tid != new_transfer_id()


def test_leg_params_name_the_other_sides_sizes() -> None:
    decode, prefill = MoriioPeer(ZMQ_D, dp_size=4, tp_size=2), MoriioPeer(ZMQ_P, dp_size=8, tp_size=1)
    assert prefill_kv_params("tx-1", decode) == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "transfer_id": "tx-1", "remote_dp_size": 4, "remote_tp_size": 2}
    write = decode_kv_params("tx-1", prefill, 5)
    assert write == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": None,
        "remote_block_ids": None, "transfer_id": "tx-1", "remote_dp_size": 8, "remote_tp_size": 1,
        "remote_dp_rank": 5}
    assert "remote_dp_rank" not in decode_kv_params("tx-1", MoriioPeer(ZMQ_P), None)


def test_read_mode_copies_the_three_handle_fields_and_nothing_else() -> None:
    answer = {"remote_engine_id": "10.0.0.1:6301", "remote_block_ids": [4, 5],
              "transfer_id": "tx-p", "remote_dp_rank_override": True, "remote_host": "10.0.0.1",
              "remote_dp_rank": 7}
    params = decode_kv_params("tx-1", MoriioPeer(ZMQ_P, dp_size=2), 1, answer)
    assert params["remote_engine_id"] == "10.0.0.1:6301"
    assert params["remote_block_ids"] == [4, 5]
    assert params["transfer_id"] == "tx-p"
    assert params["remote_dp_rank"] == 1  # the proxy's choice, not the prefill's answer
    assert "remote_dp_rank_override" not in params and "remote_host" not in params


def _reg(**changes: Any) -> Any:
    reg = parse_frames(frames(payload(**changes)))
    assert reg is not None
    return reg


def test_the_first_registration_fixes_the_mode_and_the_other_is_refused() -> None:
    roster, created = register_moriio(Roster(), _reg(), COUNTERS, now=1.0)
    assert created and roster.transfer_mode == "READ" and roster.version == 1
    with pytest.raises(RegistrationRefused, match="WRITE"):
        register_moriio(roster, _reg(type="D", http_address="10.0.0.2:8200", zmq_address=ZMQ_D,
                                     transfer_mode="WRITE"), COUNTERS, now=2.0)
    # A heartbeat that changes nothing keeps the version; the time moves on.
    again, created = register_moriio(roster, _reg(), COUNTERS, now=3.0)
    assert not created and again.version == 1 and again.members[0].registered_at == 3.0
    # A role change for a known instance is refused too.
    with pytest.raises(RegistrationRefused, match="already known"):
        register_moriio(again, _reg(type="D"), COUNTERS, now=4.0)
    # The roster survives the trip through shared memory with its MoRIIO fields.
    assert Roster.from_bytes(again.to_bytes()) == again


def test_silence_past_the_ttl_is_what_expires() -> None:
    roster, _ = register_moriio(Roster(), _reg(), COUNTERS, now=100.0)
    assert silent_moriio(roster, now=109.9, ttl=10) == []
    assert silent_moriio(roster, now=110.0, ttl=10) == ["http://10.0.0.1:8100"]


def test_the_roster_takes_a_bounded_number_of_moriio_instances() -> None:
    roster, _ = register_moriio(Roster(), _reg(), COUNTERS, now=1.0, limit=2)
    roster, _ = register_moriio(roster, _reg(http_address="10.0.0.9:1"), COUNTERS, 1.0, limit=2)
    with pytest.raises(RegistrationRefused, match="already holds 2"):
        register_moriio(roster, _reg(http_address="10.0.0.9:2"), COUNTERS, 1.0, limit=2)
    refreshed, created = register_moriio(roster, _reg(), COUNTERS, now=2.0, limit=2)
    assert not created and len(refreshed.members) == 2  # a known one still refreshes
