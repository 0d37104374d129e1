"""The MoRIIO registration listener: a ZMQ ROUTER socket on the trio loop, owned by the lifespan.

vLLM's MoRIIO instances send one msgpack map every 3 s from a DEALER socket, and expect no reply
(``_core/moriio.py`` parses it). pyzmq has no trio integration, so the socket is driven from its
``zmq.FD``: that descriptor is *edge*-triggered (it becomes readable when the socket's state may
have changed, not while messages wait), so the rule is to drain while ``zmq.EVENTS`` says
``POLLIN`` and only then wait on the descriptor. Waiting first would sleep forever on messages that
arrived before the last edge. No thread: every frame is handled on the loop, where the roster
lives.

Bad traffic never stops it (upstream's listener dies on the first bad frame and the roster
freezes): a frame that does not parse, or a registration the roster refuses, is logged and
dropped. Memory stays bounded under a flood: ZMQ drops a peer whose message is over
``MAXMSGSIZE`` before buffering it, at most ``RCVHWM`` messages queue per peer, the drain yields
to the loop every ``_BATCH`` messages, and the log lines are rate-limited per reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio
import zmq

from .._core.errors import MalformedRegistration, RegistrationRefused, RosterFull
from .._core.moriio import MAX_FRAME_BYTES, MoriioRegistration, parse_frames

log = logging.getLogger("epd_trio.moriio")

#: Messages handled between two checkpoints: a flood must not starve the HTTP side.
_BATCH = 64
#: Messages ZMQ queues per connected peer before it drops more (a registration is ~200 bytes).
_RECEIVE_HWM = 256


@dataclass
class DropLog:
    """Rate-limited log lines for dropped registrations: one line per reason per ``window``
    seconds, with the count of the lines it held back, so a flood of garbage costs one line, not
    one per frame (and an instance with the wrong mode, which beats every 3 s, one per window)."""

    window: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    #: At most this many reasons are tracked (the reasons of a flood are bounded text, but many).
    max_reasons: int = 256

    def drop(self, level: int, reason: str) -> bool:
        """Count one drop; log it unless this reason was logged within the window. True if
        logged."""
        now = self.clock()
        last, held = self._seen.get(reason, (None, 0))
        if last is not None and now - last < self.window:
            self._seen[reason] = (last, held + 1)
            return False
        if len(self._seen) >= self.max_reasons and reason not in self._seen:
            self._seen.clear()
        self._seen[reason] = (now, 0)
        suffix = f" ({held} more like it not logged)" if held else ""
        log.log(level, "MoRIIO registration dropped: %s%s", reason, suffix)
        return True


def zmq_endpoint(bind: str) -> str:
    """``host:port`` as a ZMQ TCP endpoint (port 0: any free port, ZMQ's ``*``)."""
    host, _, port = bind.rpartition(":")
    return f"tcp://{host}:{'*' if port == '0' else port}"


class RegistrationListener:
    """The ROUTER socket and its loop. ``run`` binds, reports the bound ``host:port`` and then
    receives until cancelled; the socket and its context are closed when it ends.

    ``register`` is told each valid registration with the clock's time (it raises
    ``RegistrationRefused`` to refuse one); ``expire`` is called every quarter of ``ttl`` with
    the time, to drop the instances that fell silent.
    """

    def __init__(
        self, bind: str, *, register: Callable[[MoriioRegistration, float], bool],
        expire: Callable[[float], object], ttl: float, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bind = bind
        self._register = register
        self._expire = expire
        self._ttl = ttl
        self._clock = clock
        self.drops = DropLog(clock=clock)
        #: Messages received, messages dropped.
        self.received = 0
        self.dropped = 0
        self._handled = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after each message is handled (tests
        synchronise on it instead of sleeping)."""
        while not predicate():
            await self._handled.wait()

    async def run(self, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        context = zmq.Context(io_threads=1)
        sock = context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
            try:
                sock.bind(zmq_endpoint(self._bind))
            except zmq.ZMQError as exc:
                raise OSError(f"cannot bind the MoRIIO registration socket on {self._bind} "
                              f"(EPD_MORIIO_REGISTRATION): {exc}") from None
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
            log.info("MoRIIO registration listening on %s", bound)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._expire_loop)
                task_status.started(bound)
                await self._receive_loop(sock)
        finally:
            sock.close(linger=0)
            context.term()

    async def _receive_loop(self, sock: zmq.Socket[bytes]) -> None:
        fd = sock.getsockopt(zmq.FD)
        while True:
            handled = 0
            # Drain first: the descriptor only signals edges (see the module docstring).
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle(frames)
                handled += 1
                if handled % _BATCH == 0:
                    await trio.lowlevel.checkpoint()
            await trio.lowlevel.wait_readable(fd)

    def handle(self, frames: Sequence[bytes]) -> None:
        """One message: register it, or log why not and drop it. Never raises."""
        try:
            self._handle(frames)
        finally:
            self.received += 1
            self._handled.set()
            self._handled = trio.Event()

    def _handle(self, frames: Sequence[bytes]) -> None:
        try:
            registration = parse_frames(frames)
            if registration is None:  # HELLO
                return
            self._register(registration, self._clock())
        except MalformedRegistration as exc:
            self.dropped += 1
            self.drops.drop(logging.WARNING, str(exc))
        except (RegistrationRefused, RosterFull) as exc:
            self.dropped += 1
            self.drops.drop(logging.ERROR, f"{registration.role} {registration.instance.url}: "
                                           f"{exc}")
        except Exception:  # a bug: it must not stop registration (upstream's did)
            self.dropped += 1
            log.exception("MoRIIO registration: unexpected error handling a frame")

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(self._ttl / 4)
            self._expire(self._clock())
