"""A KV event publisher that speaks vLLM's ``ZmqEventPublisher`` wire exactly, on the trio loop.

vLLM (``vllm/distributed/kv_events.py``) gives each DP rank its own sockets, the ports offset by
the rank (``offset_endpoint_port``: rank r on base + r):

- a PUB socket sending 3 frames per batch: the topic, the sequence number (8 bytes big-endian,
  from 0, +1 per batch) and the msgpack ``[ts, [events], dp_rank]`` (the proxy's own encoder,
  ``epd_trio._kv.wire.encode_batch``: tagged maps, or with ``positional`` the older arrays);
- a ROUTER replay socket: a request is ``[identity, b"", start_seq (8 bytes big-endian)]`` (a
  DEALER sends ``[b"", start_seq]``); it answers each buffered batch with ``seq >= start_seq``
  as ``[identity, b"", topic, seq, payload]``, then ``[identity, b"", b"", END_SEQ, b""]`` with
  ``END_SEQ`` = -1 in 8 signed bytes (``END_OF_REPLAY`` in ``_kv.wire``; vLLM 0.32, seen on
  the real server; earlier versions sent no topic frame). Any other request shape is ignored,
  unanswered. The buffer keeps the last ``buffer_steps`` batches (10 000 on vLLM), so a gap
  older than that cannot be filled.

The PUB side is an XPUB socket here: a SUB sees the same frames, and the publisher learns of
each subscription, so a test can wait for its subscriber instead of sleeping past ZMQ's slow
joiner. pyzmq has no trio integration, so the sockets are driven from ``zmq.FD`` as in
``epd_trio._membership.moriio_listener``: the descriptor is edge-triggered, so drain while
``zmq.EVENTS`` has ``POLLIN``, then wait (and drain again after each send, which can consume an
edge).

Test knobs: ``drop_next`` (a batch is numbered and buffered but not sent: a lost message that
replay can fill), ``forget`` (the buffer loses old batches, as a full one does: a gap replay
cannot fill), ``answer_replays = False`` (replay requests read and never answered: the
requester times out), ``restart`` (the sequence back to 0 and the buffer empty, as a restarted
vLLM; optionally an ``AllBlocksCleared`` first), ``publish_payload`` (a numbered batch whose
payload is anything), ``send_raw`` / ``send_malformed`` (bad frames, no number used).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio
import zmq

from .._kv.wire import (
    END_OF_REPLAY,
    AllBlocksCleared,
    KvEvent,
    encode_batch,
    encode_message,
    encode_seq,
)

log = logging.getLogger("epd_trio.testing.kv_publisher")

#: vLLM's defaults (``KVEventsConfig``): batches kept for replay, and the PUB high-water mark.
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
#: Tries to find a free run of ``dp_size`` consecutive ports when asked for any port.
_BIND_ATTEMPTS = 20


@dataclass(frozen=True, slots=True)
class KVEndpoints:
    """Where a subscriber connects: one PUB and one replay endpoint per DP rank."""

    publish: list[str]
    replay: list[str] | None


@dataclass(eq=False)
class _Rank:
    pub: zmq.Socket[bytes]
    replay: zmq.Socket[bytes] | None
    buffer: deque[tuple[int, bytes]]
    next_seq: int = 0
    drop: int = 0
    #: Subscriptions the XPUB socket saw (``XPUB_VERBOSE``: one per subscribing socket).
    subscriptions: int = 0
    published: int = 0
    replays: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class KVEventPublisher:
    """The publisher of one fake instance. Start it with ``await nursery.start(pub.run)``: it
    binds every rank's sockets on ``host`` (``port`` 0: any free run of ports; else rank r on
    ``port + r``, likewise ``replay_port``; ``replay_port=None``: no replay socket), reports
    the ``KVEndpoints``, and serves replay requests until cancelled. ``positional``: events in
    the shape vLLM wrote before May 2026."""

    def __init__(self, *, dp_size: int = 1, host: str = "127.0.0.1", port: int = 0,
                 replay_port: int | None = 0, topic: str = "kv", positional: bool = False,
                 buffer_steps: int = DEFAULT_BUFFER_STEPS, hwm: int = DEFAULT_HWM,
                 clock: Callable[[], float] = time.time) -> None:
        if dp_size < 1 or buffer_steps < 0:
            raise ValueError("dp_size must be >= 1 and buffer_steps >= 0")
        self.dp_size = dp_size
        self.positional = positional
        self.topic = topic.encode()
        self.endpoints: KVEndpoints | None = None
        #: False: replay requests are read and never answered (the requester times out).
        self.answer_replays = True
        self._host, self._port, self._replay_port = host, port, replay_port
        self._buffer_steps, self._hwm, self._clock = buffer_steps, hwm, clock
        self._ranks: list[_Rank] = []

    # -- publishing ----------------------------------------------------------------------------
    def publish(self, dp_rank: int, events: Sequence[KvEvent], ts: float | None = None) -> int:
        """Send one batch from ``dp_rank`` (an ``EventSink``); returns its sequence number.
        Never blocks: like vLLM's PUB, a batch past the high-water mark is dropped by ZMQ."""
        return self.publish_payload(dp_rank, encode_batch(
            events, ts=self._clock() if ts is None else ts, dp_rank=dp_rank,
            positional=self.positional))

    def publish_payload(self, dp_rank: int, payload: bytes) -> int:
        """Number, buffer and send one batch given as its payload (anything: a malformed
        batch under a good sequence number); returns its sequence number."""
        rank = self._rank(dp_rank)
        seq = rank.next_seq
        rank.next_seq += 1
        rank.buffer.append((seq, payload))
        if rank.drop:
            rank.drop -= 1
        else:
            self._send(rank, encode_message(self.topic, seq, payload))
        rank.published += 1
        rank.notify()
        return seq

    def drop_next(self, dp_rank: int = 0, count: int = 1) -> None:
        """Lose the next ``count`` batches of ``dp_rank`` on the wire (still numbered and
        buffered, so a replay can fill the gap while the buffer holds them)."""
        self._rank(dp_rank).drop += count

    def forget(self, dp_rank: int = 0, *, below: int) -> None:
        """Drop ``dp_rank``'s buffered batches numbered below ``below``, as a full replay buffer
        does: a gap among them can no longer be filled."""
        buffer = self._rank(dp_rank).buffer
        while buffer and buffer[0][0] < below:
            buffer.popleft()

    def restart(self, dp_rank: int | None = None, *, clear: bool = False) -> None:
        """Behave like a restarted vLLM on ``dp_rank`` (None: all): the next batch is number 0
        and the replay buffer is empty. ``clear``: publish an ``AllBlocksCleared`` first (a
        fresh vLLM sends nothing: a consumer has to notice the sequence going back)."""
        for index in range(self.dp_size) if dp_rank is None else (dp_rank,):
            rank = self._rank(index)
            rank.next_seq = 0
            rank.buffer.clear()
            if clear:
                self.publish(index, [AllBlocksCleared()])

    def send_raw(self, dp_rank: int, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on ``dp_rank``'s PUB socket (no sequence number is used)."""
        self._send(self._rank(dp_rank), list(frames))

    def send_malformed(self, dp_rank: int = 0) -> None:
        """Send a message whose payload is not msgpack, numbered as the next batch would be."""
        rank = self._rank(dp_rank)
        self.send_raw(dp_rank, encode_message(self.topic, rank.next_seq, b"\xc1 not msgpack"))

    # -- observation ---------------------------------------------------------------------------
    def next_seq(self, dp_rank: int = 0) -> int:
        return self._rank(dp_rank).next_seq

    def subscriptions(self, dp_rank: int = 0) -> int:
        return self._rank(dp_rank).subscriptions

    def replays(self, dp_rank: int = 0) -> int:
        """Replay requests answered."""
        return self._rank(dp_rank).replays

    async def wait_until(self, dp_rank: int, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked on every change of ``dp_rank``."""
        while not predicate():
            await self._rank(dp_rank).changed.wait()

    async def wait_subscribed(self, dp_rank: int = 0, count: int = 1) -> None:
        """Wait until ``count`` subscriptions reached ``dp_rank`` (from then on nothing
        published is lost to ZMQ's slow joiner)."""
        rank = self._rank(dp_rank)
        await self.wait_until(dp_rank, lambda: rank.subscriptions >= count)

    # -- the sockets ---------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[KVEndpoints] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        context = zmq.Context(io_threads=1)
        sockets: list[zmq.Socket[bytes]] = []
        try:
            pubs, pub_urls = self._bind(context, sockets, zmq.XPUB, self._port)
            replays: list[zmq.Socket[bytes]] | None = None
            replay_urls = None
            if self._replay_port is not None:
                replays, replay_urls = self._bind(context, sockets, zmq.ROUTER, self._replay_port)
            self._ranks = [
                _Rank(pub, replays[i] if replays else None, deque(maxlen=self._buffer_steps))
                for i, pub in enumerate(pubs)]
            self.endpoints = KVEndpoints(pub_urls, replay_urls)
            async with trio.open_nursery() as nursery:
                for rank in self._ranks:
                    nursery.start_soon(self._serve, rank.pub, self._subscriptions_from, rank)
                    if rank.replay is not None:
                        nursery.start_soon(self._serve, rank.replay, self._replay_to, rank)
                task_status.started(self.endpoints)
        finally:
            self._ranks = []
            for sock in sockets:
                sock.close(linger=0)
            context.term()

    def _bind(self, context: zmq.Context[zmq.Socket[bytes]], owned: list[zmq.Socket[bytes]],
              kind: int, port: int) -> tuple[list[zmq.Socket[bytes]], list[str]]:
        """``dp_size`` sockets on consecutive ports from ``port`` (0: from any free port)."""
        for _ in range(_BIND_ATTEMPTS if port == 0 else 1):
            socks: list[zmq.Socket[bytes]] = []
            try:
                base = port
                for index in range(self.dp_size):
                    sock = context.socket(kind)
                    owned.append(sock)
                    socks.append(sock)
                    sock.setsockopt(zmq.LINGER, 0)
                    if kind == zmq.XPUB:
                        sock.setsockopt(zmq.SNDHWM, self._hwm)
                        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
                    if index == 0 and port == 0:
                        sock.bind(f"tcp://{self._host}:*")
                        base = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
                    else:
                        sock.bind(f"tcp://{self._host}:{base + index}")
                return socks, [f"tcp://{self._host}:{base + i}" for i in range(self.dp_size)]
            except zmq.ZMQError as exc:
                for sock in socks:
                    sock.close(linger=0)
                    owned.remove(sock)
                if port != 0:
                    raise OSError(f"cannot bind KV event sockets from port {port}: {exc}") from None
        raise OSError(f"no run of {self.dp_size} free ports on {self._host}")

    async def _serve(self, sock: zmq.Socket[bytes], handle: Callable[[_Rank, list[bytes]], None],
                     rank: _Rank) -> None:
        fd = sock.getsockopt(zmq.FD)
        while True:
            self._drain(sock, handle, rank)
            await trio.lowlevel.wait_readable(fd)

    @staticmethod
    def _drain(sock: zmq.Socket[bytes], handle: Callable[[_Rank, list[bytes]], None],
               rank: _Rank) -> None:
        # Drain first: the descriptor only signals edges (see the module docstring).
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            handle(rank, frames)

    def _send(self, rank: _Rank, frames: list[bytes]) -> None:
        try:
            rank.pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: dropped, as PUB does
            log.debug("KV event batch dropped at the high-water mark")
        # A send can take the edge a waiting subscription message needed.
        self._drain(rank.pub, self._subscriptions_from, rank)

    def _subscriptions_from(self, rank: _Rank, frames: list[bytes]) -> None:
        if frames and frames[0][:1] == b"\x01":
            rank.subscriptions += 1
            rank.notify()

    def _replay_to(self, rank: _Rank, frames: list[bytes]) -> None:
        """Answer one replay request exactly as ``ZmqEventPublisher._service_replay`` does (or
        read it and say nothing, without ``answer_replays``)."""
        sock = rank.replay
        assert sock is not None
        if not self.answer_replays:
            return
        if len(frames) != 3:
            log.warning("invalid KV event replay request: %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        try:
            for seq, payload in rank.buffer:
                if seq >= start:
                    sock.send_multipart([client, b"", self.topic, encode_seq(seq), payload],
                                        zmq.NOBLOCK)
            sock.send_multipart([client, b"", b"", END_OF_REPLAY, b""], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("KV event replay cut short: the requester's queue is full")
        rank.replays += 1
        rank.notify()

    def _rank(self, dp_rank: int) -> _Rank:
        if not self._ranks:
            raise RuntimeError("the KV event publisher is not running (nursery.start(pub.run))")
        return self._ranks[dp_rank]
