"""The one Redis command on a request's path, ``INCRBY`` for the global cursor, on a lean link.

Why not coredis, which the rest of the state link uses: measured in ``bench.replicas``
(docs/how-to/replicas.md), a coredis call cost 150-220 µs of CPU, and under 48 concurrent requests per
replica its replies came later than the cursor's 50 ms timeout thousands of times per run, so
the "exact" global cursor fell back to the local one. A request asks for at most three
increments, each a few dozen bytes of Redis's own protocol (RESP) and an integer back: this
module speaks exactly that and nothing else, on a connection of its own.

How: callers append their command to an output buffer and their reply slot to a FIFO, both in
one synchronous step, then wait for the slot. One writer task sends whatever has accumulated
in one ``send_all`` (so a burst of requests is pipelined into few writes), one reader task
parses replies in order and fills the slots. A caller that gives up (its timeout, or its
request cancelled) leaves its slot behind; the reply still comes and is dropped. An error
reply is that command's answer (the stream stays aligned): its caller gets ``CommandRefused``
(a counter key holding something else than a number, written by hand: the owner counts it
and the cursor falls back), and the link goes on. Any protocol surprise or end of stream
breaks the link: the reader raises, the owner (``_state_sync.StateLink``) reconnects, and
the callers waiting get ``LinkBroken`` (the cursor then falls back, counted).
"""

from __future__ import annotations

import ssl
from collections import deque

import trio

from .._core.state_url import StateURL
from .tls import tls_context

#: Bytes read per receive.
READ_SIZE = 65536


class LinkBroken(Exception):
    """The connection is gone or spoke something other than integer replies."""


class CommandRefused(Exception):
    """Redis answered one command with an error (``WRONGTYPE``, ``ERR value is not an
    integer``): that command failed, the link did not."""


def command(*parts: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


Reply = int | bytes | CommandRefused | list[int]


def parse_replies(buffer: bytearray) -> list[Reply]:
    """Take every complete simple reply off the front of ``buffer``: integers (``:n``), status
    lines (``+OK``, as bytes), error lines (``-ERR ...``, as ``CommandRefused``) and arrays of
    integers (``*n``, a script's answer, as a list). Any other type is ``LinkBroken``."""
    replies: list[Reply] = []
    pos = 0
    while (parsed := _one_reply(buffer, pos)) is not None:
        reply, pos = parsed
        replies.append(reply)
    del buffer[:pos]
    return replies


def _one_reply(buffer: bytearray, pos: int) -> tuple[Reply, int] | None:
    """The reply that starts at ``pos`` and where the next one starts; None: incomplete."""
    end = buffer.find(b"\r\n", pos)
    if end < 0:
        return None
    line = bytes(buffer[pos:end])
    pos = end + 2
    kind, rest = line[:1], line[1:]
    if kind == b":":
        try:
            return int(rest), pos
        except ValueError:
            raise LinkBroken(f"bad integer reply {line[:64]!r}") from None
    if kind == b"+":
        return rest, pos
    if kind == b"-":
        return CommandRefused(f"Redis answered {rest[:200].decode(errors='replace')}"), pos
    if kind == b"*" and rest.isdigit():
        items: list[int] = []
        for _ in range(int(rest)):
            parsed = _one_reply(buffer, pos)
            if parsed is None:
                return None
            item, pos = parsed
            if not isinstance(item, int):
                raise LinkBroken(f"an array holding {item!r}, not integers")
            items.append(item)
        return items, pos
    raise LinkBroken(f"unexpected reply {line[:64]!r}")


class _Slot:
    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Reply | None = None
        self.error: BaseException | None = None


class CursorLink:
    """A pipelined RESP connection for ``INCRBY`` (and the limits' scripts); ``run`` its reader
    and writer in a nursery."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._out = bytearray()
        self._waiting: deque[_Slot] = deque()
        self._wake = trio.Event()
        self._broken: BaseException | None = None

    @classmethod
    async def open(cls, url: StateURL, tls: ssl.SSLContext | None = None) -> CursorLink:
        """Connect, authenticate and select the database (the caller bounds the time).
        ``tls``: the context of a ``rediss://`` URL; when not given,
        ``_state_tls.tls_context(url)`` (the URL's ``ssl_ca_certs`` and client certificate,
        the rule of ``_state_sync.redis_client`` too)."""
        context = tls if tls is not None else tls_context(url)  # before any socket is open
        if url.scheme == "unix":
            assert url.path is not None
            stream: trio.abc.Stream = await trio.open_unix_socket(url.path)
        else:
            assert url.host is not None and url.port is not None
            stream = await trio.open_tcp_stream(url.host, url.port)
            if url.tls:
                assert context is not None  # tls_context's answer for a rediss:// URL
                stream = trio.SSLStream(stream, context, server_hostname=url.host)
        link = cls(stream)
        try:
            if isinstance(stream, trio.SSLStream):
                await stream.do_handshake()  # a certificate refused fails the connect, not a take
            hello = []
            if url.password is not None:
                user = [url.username.encode()] if url.username else []
                hello.append(command(b"AUTH", *user, url.password.encode()))
            if url.db:
                hello.append(command(b"SELECT", str(url.db).encode()))
            if hello:
                await stream.send_all(b"".join(hello))
                await link._read_exactly(len(hello))
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return link

    async def _read_exactly(self, count: int) -> list[Reply]:
        """The replies to the greeting (``AUTH``, ``SELECT``): any error breaks the link."""
        buffer = bytearray()
        replies: list[Reply] = []
        while len(replies) < count:
            data = await self._stream.receive_some(READ_SIZE)
            if not data:
                raise LinkBroken("Redis closed the connection")
            buffer += data
            replies += parse_replies(buffer)
        for reply in replies:
            if isinstance(reply, CommandRefused):
                raise LinkBroken(str(reply))
        return replies

    async def incrby(self, key: bytes, n: int) -> int:
        """``INCRBY key n``: the new value. ``LinkBroken`` when the link is gone,
        ``CommandRefused`` when Redis refused this increment (the key is not a number)."""
        value = await self.call(b"INCRBY", key, str(n).encode())
        if not isinstance(value, int):
            raise LinkBroken(f"INCRBY answered {value!r}")
        return value

    async def call(self, *parts: bytes) -> Reply:
        """One command and its reply (``LinkBroken``, ``CommandRefused`` as for ``incrby``)."""
        slot = self.send(*parts)
        await slot.done.wait()
        if slot.error is not None:
            raise LinkBroken(str(slot.error))
        if isinstance(slot.value, CommandRefused):
            raise slot.value  # this call's own reply: no other caller holds it
        assert slot.value is not None
        return slot.value

    def send(self, *parts: bytes) -> _Slot:
        """Queue one command (sent by the writer with whatever else is queued); its slot, which
        a caller that does not need the reply may leave behind."""
        if self._broken is not None:
            raise LinkBroken(str(self._broken))
        slot = _Slot()
        self._out += command(*parts)
        self._waiting.append(slot)
        self._wake.set()
        return slot

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer and the reader, until the stream ends or breaks (then raises), or until
        cancelled; the stream is closed on the way out and every waiting caller released."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write)
                task_status.started()
                await self._read()
        except BaseException as exc:
            self._broken = exc
            raise
        finally:
            for slot in self._waiting:
                slot.error = self._broken or LinkBroken("link closed")
                slot.done.set()
            self._waiting.clear()
            await trio.aclose_forcefully(self._stream)

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            data, self._out = bytes(self._out), bytearray()
            if data:
                await self._stream.send_all(data)

    async def _read(self) -> None:
        buffer = bytearray()
        while True:
            data = await self._stream.receive_some(READ_SIZE)
            if not data:
                raise LinkBroken("Redis closed the connection")
            buffer += data
            for reply in parse_replies(buffer):
                if not self._waiting:
                    raise LinkBroken("a reply nobody asked for")
                slot = self._waiting.popleft()
                slot.value = reply
                slot.done.set()
