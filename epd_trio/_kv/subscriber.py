"""The I/O shell: one ZMQ subscription per slot on the trio loop, and their owner ``KvEvents``.

Per slot, a SUB socket connected to the engine's PUB (the configured port plus the DP rank:
``_core.routing.KvEventEndpoints.for_rank``), subscribed to the configured topic, and, when the
engine has one, a DEALER to its replay ROUTER. ``feed.Feed`` decides what each batch means;
this module only moves frames and applies the steps to the shared ``index.KvIndex``. pyzmq has
no trio integration, so each socket is driven from its ``zmq.FD`` as
``_membership/moriio_listener.py`` does: drain while ``zmq.EVENTS`` says ``POLLIN``, then wait
on the (edge-triggered) descriptor. No thread: the index is touched only on the loop, so it needs no lock.

Replay: while a replay runs, the SUB socket is not read (ZMQ queues what arrives, up to its
high-water mark; what it drops shows as a later gap). Each wait for a reply has a deadline
(``replay_timeout``); on expiry the DEALER is closed, so a late answer to this request cannot be
read as the answer to the next, and the feed says what the held batch becomes. Until the engine
has answered a replay once, or sent a batch live, the first replay is asked again (each wait
twice the last, up to a minute): an engine too busy to answer in time while no request flows
would otherwise leave its slot FALLBACK for good.

Error handling: nothing that arrives stops a subscription. A malformed message or replay reply
is counted and dropped (a batch that does not decode loses its events: the slot degrades); an
unexpected exception while applying one is logged, and the slot degrades too, since its entries
may be half-applied. An absent publisher raises nothing: ZMQ keeps reconnecting, and the slot
stays FALLBACK until batches arrive. An endpoint ZMQ refuses outright is logged and the slot
stays FALLBACK.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import trio
import zmq

from .feed import Action, Feed, Reset, Step
from .index import KvIndex, Slot, SlotStats
from .wire import (
    MalformedKvMessage,
    decode_batch,
    decode_replay_reply,
    encode_replay_request,
    split_message,
)

log = logging.getLogger("epd_trio.kv_events")

#: How long a replay may stay silent before it counts as failed (each reply restarts it).
DEFAULT_REPLAY_TIMEOUT = 2.0
#: The longest wait between two asks of a replay socket that never answered.
_MAX_FIRST_REPLAY_WAIT = 60.0
#: Messages handled between two checkpoints: a burst or a long replay must not starve the loop.
_BATCH = 64
#: Messages ZMQ queues per subscription (vLLM's PUB high-water mark is 100,000).
_RECEIVE_HWM = 100_000
#: A batch larger than this drops the connection (shows as a gap): far above vLLM's batches.
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SlotSource:
    """Where one slot's events come from: the PUB endpoint of its engine's DP rank (already
    offset: ``_core.routing.KvEventEndpoints.for_rank``) and its replay endpoint, if the engine has one."""

    slot: Slot
    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class SlotReport:
    """One slot's state: the index's counters and trust, and the subscription's."""

    source: SlotSource
    index: SlotStats
    received: int
    malformed: int
    gaps: int
    replays: int
    replay_failures: int
    restarts: int
    duplicates: int


class SlotSubscriber:
    """One slot's subscription. ``run`` connects, reports started, and follows the engine until
    cancelled; its sockets close when it ends."""

    def __init__(self, source: SlotSource, index: KvIndex, context: zmq.Context[zmq.Socket[bytes]], *,
                 topic: bytes = b"", replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic,
                 changed: Callable[[], None] = lambda: None) -> None:
        self.source = source
        self.feed = Feed(has_replay=source.replay_endpoint is not None)
        self._index = index
        self._context = context
        self._topic = topic
        self._replay_timeout = replay_timeout
        self._clock = clock
        self._changed = changed
        self._dealer: zmq.Socket[bytes] | None = None
        self._scope = trio.CancelScope()
        #: Whether this engine has told us where its history starts: its replay socket answered
        #: once, or a batch arrived live. Until then the first replay is asked again.
        self._synced = False
        self.received = 0
        self.malformed = 0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sub = self._context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
            sub.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            with self._scope:
                refused = _connect(sub, self.source.endpoint)
                task_status.started()
                if refused is not None:
                    log.error("KV events of %s: cannot subscribe to %s: %s", self.source.slot,
                              self.source.endpoint, refused)
                    await trio.sleep_forever()
                await self._catch_up()
                await self._receive_loop(sub)
        finally:
            sub.close(linger=0)
            self._close_dealer()

    def stop(self) -> None:
        """End ``run`` (at once if it has not started yet)."""
        self._scope.cancel()

    async def _catch_up(self) -> None:
        """Start: ask the replay socket (if any) for all it holds, from seq 0."""
        start = self.feed.begin()
        if start is None:
            return
        try:
            self._follow(await self._replay(start), None)
        except Exception:  # a bug: as in the receive loop
            log.exception("KV events of %s: unexpected error in the first replay", self.source.slot)
            self._recover()

    async def _receive_loop(self, sub: zmq.Socket[bytes]) -> None:
        fd = sub.getsockopt(zmq.FD)
        retry = self._replay_timeout
        while True:
            handled = 0
            # Drain first: the descriptor only signals edges (see the module docstring).
            while sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    await self._handle(frames)
                except Exception:  # a bug: it must not end the subscription (nor its owner)
                    log.exception("KV events of %s: unexpected error handling a message",
                                  self.source.slot)
                    self._recover()
                handled += 1
                if handled % _BATCH == 0:
                    await trio.lowlevel.checkpoint()
            if self._synced or self.source.replay_endpoint is None:
                await trio.lowlevel.wait_readable(fd)
                continue
            # The first replay went unanswered (an engine still starting, or too busy to serve
            # it in time) and nothing came live: with no traffic nothing ever would, and the
            # slot would stay FALLBACK. Ask again, each wait twice the last.
            with trio.move_on_after(retry) as waited:
                await trio.lowlevel.wait_readable(fd)
            if waited.cancelled_caught:
                retry = min(retry * 2, _MAX_FIRST_REPLAY_WAIT)
                await self._catch_up()

    async def _handle(self, frames: list[bytes]) -> None:
        self.received += 1
        self._synced = True
        try:
            _, seq, payload = split_message(frames)
        except MalformedKvMessage as exc:
            self._malformed(exc)
            return
        step = self.feed.received(seq)
        if step.action is Action.REPLAY:
            self._reset(step.reset)
            assert self.feed.replay_from is not None
            step = await self._replay(self.feed.replay_from)
        self._follow(step, payload)

    def _recover(self) -> None:
        """After a bug: the slot's entries and the feed's state are suspect; start over,
        degraded (the next batch decides, with a replay if there is a replay socket)."""
        self._close_dealer()
        self.feed = Feed(has_replay=self.source.replay_endpoint is not None)
        self._index.lost(self.source.slot, self._clock())
        self._changed()

    async def _replay(self, start: int) -> Step:
        """Ask the replay socket for every batch from ``start``, apply them as the feed says,
        and return the feed's step for the batch held meanwhile (if any)."""
        try:
            dealer = self._open_dealer()
            dealer.send_multipart(encode_replay_request(start), zmq.NOBLOCK)
            handled = 0
            while True:
                frames = await self._next(dealer)
                if frames is None:
                    log.warning("KV events of %s: no replay from %s within %.1f s",
                                self.source.slot, self.source.replay_endpoint, self._replay_timeout)
                    break
                reply = decode_replay_reply(frames)
                if reply is None:
                    self._synced = True
                    return self.feed.replay_ended()
                seq, payload = reply
                self._follow(self.feed.replayed(seq), payload)
                handled += 1
                if handled % _BATCH == 0:
                    await trio.lowlevel.checkpoint()
        except MalformedKvMessage as exc:
            self._malformed(exc)
        except zmq.ZMQError as exc:
            log.warning("KV events of %s: replay from %s failed: %s", self.source.slot,
                        self.source.replay_endpoint, exc)
        self._close_dealer()
        step = self.feed.replay_failed()
        self._changed()
        return step

    async def _next(self, sock: zmq.Socket[bytes]) -> list[bytes] | None:
        """The next message on ``sock``, or None after ``replay_timeout`` of silence."""
        with trio.move_on_after(self._replay_timeout):
            while True:
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    try:
                        return sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
        return None

    def _follow(self, step: Step, payload: bytes | None) -> None:
        """Apply one step: the reset, then the batch if the step says so."""
        self._reset(step.reset)
        if step.action is Action.APPLY and payload is not None:
            try:
                batch = decode_batch(payload)
            except MalformedKvMessage as exc:
                self._malformed(exc)
                self._reset(self.feed.malformed().reset)
                return
            try:
                self._index.apply(self.source.slot, batch.events)
            except Exception:  # a bug: the slot's entries may be half-applied
                log.exception("KV events of %s: unexpected error applying a batch", self.source.slot)
                self._index.lost(self.source.slot, self._clock())
        self._changed()

    def _reset(self, reset: Reset) -> None:
        if reset is Reset.FRESH:
            self._index.fresh(self.source.slot, self._clock())
        elif reset is Reset.LOST:
            self._index.lost(self.source.slot, self._clock())

    def _malformed(self, exc: MalformedKvMessage) -> None:
        self.malformed += 1
        if self.malformed & (self.malformed - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood is a few lines
            log.warning("KV events of %s: malformed message dropped (%d so far): %s",
                        self.source.slot, self.malformed, exc)
        self._changed()

    def _open_dealer(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
            assert self.source.replay_endpoint is not None
            try:
                dealer.connect(self.source.replay_endpoint)
            except zmq.ZMQError:
                dealer.close(linger=0)
                raise
            self._dealer = dealer
        return self._dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


def _connect(sock: zmq.Socket[bytes], endpoint: str) -> zmq.ZMQError | None:
    """Connect; the error if ZMQ refuses the endpoint itself (an unreachable one is not refused:
    ZMQ keeps trying)."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        return exc
    return None


class KvEvents:
    """The owner: the index, the ZMQ context, and one subscriber task per slot with events.

    ``run`` (started with ``await nursery.start(events.run)`` in a lifespan nursery) owns the
    context and the nursery the subscribers run in; ``reconcile`` starts and stops them to match
    the slots given. A slot without events is simply not given: the index does not know it, and
    ``match`` never reports it (FALLBACK). ``match`` and ``speculate`` use this owner's clock.
    """

    def __init__(self, index: KvIndex | None = None, *, topic: str = "",
                 replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index if index is not None else KvIndex()
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._clock = clock
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._nursery: trio.Nursery | None = None
        self._running: dict[Slot, SlotSubscriber] = {}
        self._changed_event = trio.Event()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        try:
            async with trio.open_nursery() as nursery:
                self._context, self._nursery = context, nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            for slot in list(self._running):
                self.index.drop_slot(slot)
            self._running.clear()
            self._context = self._nursery = None
            context.term()  # every subscriber has closed its sockets by now

    async def reconcile(self, sources: Iterable[SlotSource]) -> None:
        """Follow exactly these slots: start subscriptions for new ones, stop those of slots not
        given (their entries are dropped), and restart a slot whose endpoints changed."""
        if self._nursery is None or self._context is None:
            raise RuntimeError("KvEvents.run is not running")
        wanted = {source.slot: source for source in sources}
        for slot, subscriber in list(self._running.items()):
            if wanted.get(slot) != subscriber.source:
                subscriber.stop()
                del self._running[slot]
                self.index.drop_slot(slot)
        for slot, source in wanted.items():
            if slot not in self._running:
                self.index.add_slot(slot)
                subscriber = SlotSubscriber(source, self.index, self._context, topic=self._topic,
                                            replay_timeout=self._replay_timeout, clock=self._clock,
                                            changed=self._changed)
                self._running[slot] = subscriber
                await self._nursery.start(subscriber.run)
        self._changed()

    def match(self, keys: Sequence[int]) -> dict[Slot, int]:
        """``KvIndex.match`` at this owner's time."""
        return self.index.match(keys, self._clock())

    def speculate(self, slot: Slot, keys: Sequence[int]) -> None:
        """``KvIndex.speculate`` at this owner's time."""
        self.index.speculate(slot, keys, self._clock())

    def stats(self) -> dict[Slot, SlotReport]:
        """Every followed slot's state, current as of now."""
        self.index.refresh(self._clock())
        return {slot: SlotReport(subscriber.source, self.index.stats(slot), subscriber.received,
                                 subscriber.malformed, subscriber.feed.gaps, subscriber.feed.replays,
                                 subscriber.feed.replay_failures, subscriber.feed.restarts,
                                 subscriber.feed.duplicates)
                for slot, subscriber in self._running.items()}

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked whenever a subscription handled something
        (tests synchronise on it instead of sleeping; give it a deadline)."""
        while not predicate():
            await self._changed_event.wait()

    def _changed(self) -> None:
        self._changed_event.set()
        self._changed_event = trio.Event()

