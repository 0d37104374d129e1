"""vLLM's MoRIIO connector, the proxy's half of its contract (pure: bytes and values in, values out).

A MoRIIO instance announces itself over ZMQ: its DP0/TP0 worker sends one msgpack map every 3 s
to the proxy's ROUTER socket (``type`` ``P``/``D``, ``http_address``, ``zmq_address``,
``dp_size``, ``tp_size``, ``transfer_mode``). The connector then finds its peer in the request
id, not in ``kv_transfer_params``: the proxy names both instances' ZMQ addresses in
``X-Request-Id``, and each side extracts the other's with its own regular expressions. This module
parses and checks a registration frame, and builds the request id and the ``kv_transfer_params``
of both legs, field by field as the connector reads them (``moriio_common.py`` and
``moriio_connector.py`` in vLLM 0.32; docs/contributing/upstream-notes/moriio-ec.md §1-2).

Why every check here: upstream's listener trusts each frame and dies on the first bad one,
freezing the roster. Everything a frame can get wrong is a ``MalformedRegistration`` with a
short reason, which the listener logs and drops.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import MalformedRegistration
from .routing import Instance

#: The role each registration ``type`` stands for (``HELLO`` is a no-op).
ROLE_OF_TYPE = {"P": "prefill", "D": "decode"}
#: The transfer modes the connector names (``MoRIIOMode.name``: upper case on the wire).
TRANSFER_MODES = ("READ", "WRITE")
#: A registration is ~200 bytes; anything much larger is not one (also the socket's
#: ``MAXMSGSIZE``, so ZMQ drops a peer that sends more before it is buffered).
MAX_FRAME_BYTES = 16 * 1024
#: Sizes beyond any real deployment are a garbled frame, not a cluster.
MAX_PARALLEL_SIZE = 4096
#: The prefix vLLM's toy proxy gives transfer ids (``MoRIIOConstants.TRANSFER_PREFIX``).
TRANSFER_PREFIX = "tx"
_REQUIRED = ("http_address", "zmq_address", "dp_size", "tp_size", "transfer_mode")


@dataclass(frozen=True, slots=True)
class MoriioPeer:
    """What a leg of the other side needs to know about an instance."""

    #: ``host:IP,handshake:PORT,notify:PORT``, verbatim as the instance sent it.
    zmq_address: str
    dp_size: int = 1
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class MoriioRegistration:
    """One valid ``P``/``D`` registration frame."""

    role: str
    instance: Instance
    peer: MoriioPeer
    transfer_mode: str


def parse_frames(frames: Sequence[bytes]) -> MoriioRegistration | None:
    """A ROUTER message (identity frame + payload) as a registration; None for ``HELLO``.

    Raises ``MalformedRegistration`` for anything else: a multipart payload, an oversized
    frame, bad msgpack, a payload that is not a map, an unknown ``type``, a missing, wrong-typed
    or out-of-range field.
    """
    if len(frames) != 2:
        raise MalformedRegistration(f"expected one payload frame, got {len(frames) - 1}")
    raw = frames[1]
    if len(raw) > MAX_FRAME_BYTES:
        raise MalformedRegistration(f"frame of {len(raw)} bytes (at most {MAX_FRAME_BYTES})")
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise MalformedRegistration(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise MalformedRegistration(f"payload is a {type(data).__name__}, not a map")
    return parse_registration_map(data)


def parse_registration_map(data: Mapping[Any, Any]) -> MoriioRegistration | None:
    """The fields of a decoded registration map (see ``parse_frames``)."""
    kind = data.get("type")
    if kind == "HELLO":
        return None
    role = ROLE_OF_TYPE.get(kind) if isinstance(kind, str) else None
    if role is None:
        raise MalformedRegistration(f"unknown type {_short(kind)}")
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise MalformedRegistration(f"missing {', '.join(missing)}")
    http_address = data["http_address"]
    if (not isinstance(http_address, str) or "/" in http_address or not _printable(http_address)
            or not _port(http_address.rpartition(":")[2])):
        raise MalformedRegistration(f"http_address must be ip:port, got {_short(http_address)}")
    dp_size = _size(data, "dp_size")
    try:
        instance = Instance(f"http://{http_address}", dp_size)
    except ValueError:
        raise MalformedRegistration(f"http_address must be ip:port, got {_short(http_address)}") \
            from None
    zmq_address = data["zmq_address"]
    if not isinstance(zmq_address, str):
        raise MalformedRegistration(f"zmq_address must be a string, got {_short(zmq_address)}")
    parse_zmq_address(zmq_address)
    mode = data["transfer_mode"]
    if mode not in TRANSFER_MODES:
        raise MalformedRegistration(f"transfer_mode must be READ or WRITE, got {_short(mode)}")
    peer = MoriioPeer(zmq_address, instance.dp_size, _size(data, "tp_size"))
    return MoriioRegistration(role, instance, peer, mode)


def parse_zmq_address(text: str) -> tuple[str, int, int]:
    """``host:IP,handshake:PORT,notify:PORT`` as ``(host, handshake, notify)``, as the connector
    parses it (each part split at its first ``:``, so ``host:::1`` is IPv6).

    Stricter than the connector where the request id needs it: the address travels in an HTTP
    header and is cut out again by regular expressions, so it must be printable ASCII without
    spaces, and must not hold ``___`` (the separator of the id's fields).
    """
    if not _printable(text) or "___" in text or len(text) > 512:
        raise MalformedRegistration(f"zmq_address unusable in a request id: {_short(text)}")
    parts: dict[str, str] = {}
    for segment in text.split(","):
        key, _, value = segment.partition(":")
        parts[key.strip()] = value.strip()
    host, handshake, notify = parts.get("host"), parts.get("handshake"), parts.get("notify")
    if not host or not _port(handshake) or not _port(notify):
        raise MalformedRegistration(
            f"zmq_address must be host:IP,handshake:PORT,notify:PORT, got {_short(text)}")
    return host, int(handshake), int(notify)  # type: ignore[arg-type]


def _port(value: str | None) -> bool:
    return value is not None and value.isdigit() and 0 < int(value) < 65536


def _size(data: Mapping[Any, Any], name: str) -> int:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PARALLEL_SIZE:
        raise MalformedRegistration(f"{name} must be an integer in 1..{MAX_PARALLEL_SIZE}, "
                                    f"got {_short(value)}")
    return value


def _printable(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable() and " " not in text


def _short(value: Any) -> str:
    """A bounded rendering of a bad value for the log (a flood must not become huge log lines)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the legs --------------------------------------------------------------------------------------
def moriio_request_id(prefill: MoriioPeer, decode: MoriioPeer, uid: str | None = None) -> str:
    """The ``X-Request-Id`` of both legs: ``___prefill_addr_{P}___decode_addr_{D}_{32 hex}``.

    The connector's producer reads the decode address out of it and its consumer the prefill
    address; both tolerate vLLM's ``chatcmpl-``/``cmpl-`` prefix and ``-suffix`` wrapping.
    """
    uid = uuid.uuid4().hex if uid is None else uid
    return f"___prefill_addr_{prefill.zmq_address}___decode_addr_{decode.zmq_address}_{uid}"


def new_transfer_id() -> str:
    """A fresh transfer id (one per attempt: both legs of the attempt share it)."""
    return f"{TRANSFER_PREFIX}-{uuid.uuid4()}"


def prefill_kv_params(transfer_id: str, decode: MoriioPeer) -> dict[str, Any]:
    """The prefill leg's ``kv_transfer_params``: keep the KV for a remote decode.

    ``remote_engine_id`` and ``remote_block_ids`` are explicit nulls because the producer reads
    those keys with ``[]``; the remote sizes are the *decode* side's.
    """
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "transfer_id": transfer_id,
            "remote_dp_size": decode.dp_size, "remote_tp_size": decode.tp_size}


def decode_kv_params(
    transfer_id: str, prefill: MoriioPeer, prefill_rank: int | None,
    prefill_answer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The decode leg's ``kv_transfer_params``: take the KV from the chosen prefill rank.

    The remote sizes are the *prefill* side's, and ``remote_dp_rank`` is the prefill rank the
    request went to (only when the prefill is DP). In READ mode ``prefill_answer`` is the
    prefill's own ``kv_transfer_params``: its ``remote_engine_id``, ``remote_block_ids`` and
    ``transfer_id`` are copied in, and nothing else (upstream's toy proxy does the same; the
    prefill's ``remote_dp_rank_override`` would change which decode rank sends the notify).
    """
    params: dict[str, Any] = {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": None,
        "remote_block_ids": None, "transfer_id": transfer_id,
        "remote_dp_size": prefill.dp_size, "remote_tp_size": prefill.tp_size,
    }
    if prefill_rank is not None:
        params["remote_dp_rank"] = prefill_rank
    if prefill_answer is not None:
        for key in ("remote_engine_id", "remote_block_ids", "transfer_id"):
            if key in prefill_answer:
                params[key] = prefill_answer[key]
    return params
