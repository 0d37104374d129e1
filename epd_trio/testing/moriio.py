"""MoRIIO stand-ins: an instance that registers like vLLM's connector, and the connector's checks.

``MoriioStandIn`` is the heartbeat side of vLLM's MoRIIO connector (``moriio_heartbeat.py``): a
pyzmq DEALER connected to the proxy's ROUTER that sends one msgpack map, one frame, every
``interval`` seconds (3 s in vLLM), and never reads a reply. ``MoriioSide`` makes a ``FakeVLLM``
check each prefill/decode leg the way the connector reads it (the request id parsed with the
connector's own regular expressions, the ``kv_transfer_params`` keys it reads with ``[]``), and
answer like its producer. ``TransferFabric`` plays the RDMA link between fakes: in WRITE mode a
decode waits until the prefill of the same ``transfer_id`` has "written" its KV, as real decode
sits in ``WAITING_FOR_REMOTE_KVS`` until the prefill's ``write_done``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import trio
import zmq

#: The connector's expressions (vLLM 0.32 ``moriio_common.py``), re-implemented: the prefill's
#: address sits lazily between the two markers; the decode's runs greedily to ``_`` + 32 hex,
#: which may be followed by vLLM's ``-suffix`` (and preceded by its ``chatcmpl-`` prefix).
PREFILL_ADDRESS = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
DECODE_ADDRESS = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")


def peer_addresses(request_id: str) -> tuple[str | None, str | None]:
    """``(prefill address, decode address)`` as the connector finds them in a request id."""
    prefill, decode = PREFILL_ADDRESS.search(request_id), DECODE_ADDRESS.search(request_id)
    return (prefill.group(1) if prefill else None, decode.group(1) if decode else None)


@dataclass
class TransferFabric:
    """The KV link between fake MoRIIO instances: which transfers a prefill has completed."""

    written: set[str] = field(default_factory=set)
    _changed: trio.Event = field(default_factory=trio.Event)

    def write(self, transfer_id: str) -> None:
        self.written.add(transfer_id)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_written(self, transfer_id: str) -> None:
        while transfer_id not in self.written:
            await self._changed.wait()


@dataclass
class MoriioSide:
    """A ``FakeVLLM``'s MoRIIO connector: its address, sizes and mode, and the shared fabric."""

    zmq_address: str
    transfer_mode: Literal["READ", "WRITE"] = "READ"
    tp_size: int = 1
    fabric: TransferFabric = field(default_factory=TransferFabric)

    def check(self, role: str, request_id: str | None, body: Mapping[str, Any]) -> str | None:
        """What the connector would refuse in this leg (None: it is usable)."""
        if not request_id:
            return "MoRIIO: no X-Request-Id"
        prefill_at, decode_at = peer_addresses(request_id)
        if prefill_at is None or decode_at is None:
            return f"MoRIIO: the request id names no peers: {request_id!r}"
        own = prefill_at if role == "prefill" else decode_at
        if own != self.zmq_address:
            return f"MoRIIO: the request id names {own!r} for this {role}, not {self.zmq_address!r}"
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return "MoRIIO: no kv_transfer_params"
        for key in ("transfer_id", "remote_block_ids", "remote_engine_id"):
            if key not in params:  # the connector reads these with []: a KeyError
                return f"MoRIIO: kv_transfer_params has no {key!r}"
        if not isinstance(params["transfer_id"], str) or not params["transfer_id"]:
            return "MoRIIO: transfer_id must be a string"
        for key in ("remote_dp_size", "remote_tp_size"):
            if not isinstance(params.get(key), int):
                return f"MoRIIO: kv_transfer_params.{key} must be an integer"
        if role == "prefill":
            if params.get("do_remote_decode") is not True or body.get("max_tokens") != 1:
                return "MoRIIO: a prefill leg needs do_remote_decode and max_tokens 1"
            if body.get("stream") is not False:
                return "MoRIIO: a prefill leg must not stream"
        elif params.get("do_remote_prefill") is not True:
            return "MoRIIO: a decode leg needs do_remote_prefill"
        elif self.transfer_mode == "READ" and not (params["remote_block_ids"]
                                                   and params["remote_engine_id"]):
            return "MoRIIO: a READ decode needs the prefill's remote_block_ids and engine id"
        return None

    def prefill_answer(self, params: Mapping[str, Any], rank: int | None, dp_size: int
                       ) -> dict[str, Any]:
        """The producer's ``kv_transfer_params`` (``request_finished``), and the KV "written"."""
        host = self.zmq_address.split(",")[0].partition(":")[2]
        handshake = self.zmq_address.split(",")[1].partition(":")[2]
        self.fabric.write(params["transfer_id"])
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3], "remote_engine_id": f"{host}:{handshake}",
                "remote_host": host, "remote_dp_rank": rank or 0, "remote_dp_rank_override": True,
                "remote_dp_size": dp_size, "tp_size": self.tp_size,
                "transfer_id": params["transfer_id"]}

    async def before_decode(self, params: Mapping[str, Any]) -> None:
        """WRITE mode: decode generates only once the prefill has pushed the KV."""
        if self.transfer_mode == "WRITE":
            await self.fabric.wait_written(params["transfer_id"])


def moriio_address(host: str, handshake: int, notify: int) -> str:
    """A ``zmq_address`` as the connector announces it."""
    return f"host:{host},handshake:{handshake},notify:{notify}"


@dataclass
class MoriioStandIn:
    """An instance's MoRIIO heartbeat: registers with ``proxy`` (``host:port``) every
    ``interval`` seconds until cancelled. Serve it with ``await nursery.start(stand_in.run)``;
    it has sent its first registration when that returns."""

    proxy: str
    role: Literal["P", "D"]
    http_address: str
    zmq_address: str
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: Literal["READ", "WRITE"] = "READ"
    interval: float = 3.0
    #: Register as soon as it runs (off: a socket that only sends what a test makes it send).
    register_at_start: bool = True
    #: Messages sent so far.
    sent: int = 0
    _socket: zmq.Socket[bytes] | None = field(default=None, repr=False)

    def payload(self) -> dict[str, Any]:
        """The map the connector sends (``_start_heartbeat`` in vLLM 0.32)."""
        return {"type": self.role, "http_address": self.http_address,
                "zmq_address": self.zmq_address, "dp_size": self.dp_size,
                "tp_size": self.tp_size, "transfer_mode": self.transfer_mode}

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        context = zmq.Context(io_threads=1)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{self.proxy}")
        self._socket = sock
        try:
            if self.register_at_start:
                self.beat()
            task_status.started()
            while True:
                await trio.sleep(self.interval)
                self.beat()
        finally:
            self._socket = None
            sock.close(linger=0)
            context.term()

    def beat(self) -> None:
        """Send one registration now (queued by ZMQ until the connection is up)."""
        self.send(msgpack.packb(self.payload()))

    def send(self, *frames: bytes) -> bool:
        """Send raw frames (one message) on the heartbeat's socket: for malformed-traffic tests.

        False when ZMQ's send queue is full (the connector then warns and tries again later).
        """
        if self._socket is None:
            raise RuntimeError("MoriioStandIn.send outside run()")
        try:
            self._socket.send_multipart(list(frames), zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.sent += 1
        return True
