"""A pyzmq socket read on the trio loop, for tests: the other end of the KV event publisher.

pyzmq has no trio integration; as in ``epd_trio._membership.moriio_listener``, ``zmq.FD`` is
edge-triggered, so ``receive`` tries a non-blocking read, then checks ``zmq.EVENTS`` (which
also lets ZMQ process its pending commands) and only then waits on the descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import trio
import zmq

from .._kv.wire import END_OF_REPLAY


class ZmqPeer:
    """One connected socket with its own context; a context manager that closes both."""

    def __init__(self, kind: int, url: str, *, subscribe: bytes = b"") -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.socket = self.context.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            self.socket.setsockopt(zmq.SUBSCRIBE, subscribe)
        self.socket.connect(url)

    def __enter__(self) -> ZmqPeer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def send(self, frames: Sequence[bytes]) -> None:
        self.socket.send_multipart(list(frames))

    async def receive(self) -> list[bytes]:
        """The next message's frames (waits for one)."""
        while True:
            try:
                return self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(self.socket.getsockopt(zmq.FD))

    async def receive_until_end(self) -> list[list[bytes]]:
        """A replay answer on a DEALER: every message up to and including the end marker."""
        messages = []
        while True:
            frames = await self.receive()
            messages.append(frames)
            if len(frames) > 1 and frames[-2] == END_OF_REPLAY:  # [b"", b"", END, b""]
                return messages


def subscriber(url: str, topic: bytes = b"") -> ZmqPeer:
    """A SUB socket on ``url`` subscribed to ``topic`` (all by default)."""
    return ZmqPeer(zmq.SUB, url, subscribe=topic)
