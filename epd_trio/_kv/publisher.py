"""A vLLM-like KV event publisher on the trio loop: for the fake vLLM and the tests.

It speaks vLLM's wire exactly (``ZmqEventPublisher`` in ``vllm/distributed/kv_events.py``): three
frames per batch on a PUB-compatible socket, sequence numbers from 0, the last ``buffer_steps``
batches kept for a replay ROUTER that answers ``[b"", start]`` with ``[b"", topic, seq, payload]``
per kept batch from ``start`` on, then ``[b"", b"", -1, b""]`` (vLLM 0.32's shape). Two
differences, both invisible to a SUB:
the socket is an XPUB, so ``wait_subscribed`` can tell when a subscription has arrived (a PUB
drops what it sends before that, which a test would otherwise have to sleep through), and the
replay is served on the loop, not from vLLM's publisher thread.

Faults a test needs are methods: ``skip`` (a batch buffered but not sent: a gap the replay
fills), ``forget`` (the buffer loses old batches: a gap it cannot), ``restart`` (numbers from 0
again, buffer empty), ``send_frames`` (anything at all), and ``answer_replays = False`` (a replay
that times out).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import trio
import zmq

from .wire import END_OF_REPLAY, KvEvent, encode_batch, encode_message

_Handler = Callable[[zmq.Socket[bytes], list[bytes]], None]
#: vLLM's default replay buffer (``KVEventsConfig.buffer_steps``).
DEFAULT_BUFFER_STEPS = 10_000


def bind_endpoint(endpoint: str) -> str:
    """``tcp://host:0`` as ZMQ's "any free port" (``tcp://host:*``); anything else unchanged."""
    head, _, port = endpoint.rpartition(":")
    return f"{head}:*" if port == "0" else endpoint


class KvEventPublisher:
    """One engine's (one DP rank's) event sockets. ``run`` binds them, reports
    ``(endpoint, replay_endpoint)`` and serves until cancelled; the sockets close when it ends.
    ``publish`` and the fault methods are plain calls (a PUB send never blocks)."""

    def __init__(self, *, endpoint: str = "tcp://127.0.0.1:0",
                 replay_endpoint: str | None = "tcp://127.0.0.1:0", topic: bytes = b"",
                 buffer_steps: int = DEFAULT_BUFFER_STEPS, dp_rank: int = 0) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.topic = topic
        self.dp_rank = dp_rank
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pub: zmq.Socket[bytes] | None = None
        #: False: replay requests are read and never answered (the subscriber times out).
        self.answer_replays = True
        #: Subscriptions seen, replay requests served (tests wait on them).
        self.subscriptions = 0
        self.replays_served = 0
        self._changed = trio.Event()

    async def run(self, task_status: trio.TaskStatus[tuple[str, str | None]] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        context = zmq.Context(io_threads=1)
        pub = context.socket(zmq.XPUB)
        router = context.socket(zmq.ROUTER) if self._replay_endpoint is not None else None
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also a repeated one
            pub.bind(bind_endpoint(self._endpoint))
            bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            replay_bound = None
            if router is not None and self._replay_endpoint is not None:
                router.setsockopt(zmq.LINGER, 0)
                router.bind(bind_endpoint(self._replay_endpoint))
                replay_bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pub = pub
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve, pub, self._subscribed)
                if router is not None:
                    nursery.start_soon(self._serve, router, self._replay)
                task_status.started((bound, replay_bound))
        finally:
            self._pub = None
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            context.term()

    def publish(self, events: Sequence[KvEvent], *, positional: bool = False) -> int:
        """Publish one batch; its seq."""
        return self.publish_payload(encode_batch(events, dp_rank=self.dp_rank, positional=positional))

    def publish_payload(self, payload: bytes) -> int:
        """Publish one batch given as its payload (anything, for a malformed one); its seq."""
        seq = self._keep(payload)
        self.send_frames(encode_message(self.topic, seq, payload))
        return seq

    def skip(self, events: Sequence[KvEvent]) -> int:
        """Number and buffer a batch without sending it: a gap the replay can fill."""
        return self._keep(encode_batch(events, dp_rank=self.dp_rank))

    def forget(self, below: int) -> None:
        """Drop buffered batches numbered below ``below``, as a full replay buffer does."""
        while self._buffer and self._buffer[0][0] < below:
            self._buffer.popleft()

    def restart(self) -> None:
        """What a restarted engine looks like from outside: numbers from 0, nothing buffered."""
        self._next_seq = 0
        self._buffer.clear()

    def send_frames(self, frames: Sequence[bytes]) -> None:
        if self._pub is None:
            raise RuntimeError("the publisher is not running")
        self._pub.send_multipart(list(frames))
        # A send can consume the descriptor's edge for a subscription that arrived meanwhile:
        # read what is pending now, or _serve would sleep on it.
        self._drain(self._pub, self._subscribed)

    async def wait_subscribed(self, count: int = 1) -> None:
        """Until ``count`` subscriptions have arrived in all (a resubscription counts)."""
        while self.subscriptions < count:
            await self._changed.wait()

    def _keep(self, payload: bytes) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        return seq

    def _subscribed(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if frames and frames[0][:1] == b"\x01":
            self.subscriptions += 1

    def _replay(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3 or not self.answer_replays:
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                # vLLM 0.32's shape: the topic before the seq (wire.decode_replay_reply).
                sock.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
        sock.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])
        self.replays_served += 1

    def _drain(self, sock: zmq.Socket[bytes], handle: _Handler) -> None:
        # Drain before any wait: zmq.FD signals edges only (see _membership/moriio_listener.py).
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            handle(sock, frames)
            self._changed.set()
            self._changed = trio.Event()

    async def _serve(self, sock: zmq.Socket[bytes], handle: _Handler) -> None:
        fd = sock.getsockopt(zmq.FD)
        while True:
            self._drain(sock, handle)
            await trio.lowlevel.wait_readable(fd)
