"""The HTTP/1.1 client connection (``_upstream/h1``) against servers that write exact bytes on a real socket.

What is checked is what a hand-rolled client gets wrong: the request leaves in one write, body
bytes that one read completed come back as one piece, an interim response is skipped, bytes
after a response and a server closing mid-body are told apart from a good end, a header that
would split the request is refused, a port nobody listens on is told apart from other connect
failures, and https works with the system's trust store.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from epd_trio._upstream.h1 import (
    ConnectError,
    ConnectRefused,
    LocalProtocolError,
    RemoteProtocolError,
    _all_refused,
    connect,
    encode_request,
)
from epd_trio._upstream.pool import UpstreamPool


class Scripted:
    """Reads each request whole (head and ``content-length`` body), then runs ``answer``."""

    def __init__(self, answer: Callable[..., object]) -> None:
        self.answer = answer
        self.first_reads: list[bytes] = []
        self.requests: list[bytes] = []
        self.connections = 0

    async def handle(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        buffer = b""
        first = True
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                if first:
                    self.first_reads.append(data)
                    first = False
                buffer += data
                while b"\r\n\r\n" in buffer:
                    head, rest = buffer.split(b"\r\n\r\n", 1)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if len(rest) < length:
                        break
                    self.requests.append(head + b"\r\n\r\n" + rest[:length])
                    buffer = rest[length:]
                    if await self.answer(stream) is False:  # type: ignore[misc]
                        return
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()


@asynccontextmanager
async def serving(server: Scripted) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, server.handle, 0,
                                                  host="127.0.0.1"))
        yield f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


def replying(*writes: bytes, close: bool = False) -> Callable[[trio.abc.Stream], object]:
    """An answer made of these writes, each one ``send_all``; ``close``: then hang up."""
    async def answer(stream: trio.abc.Stream) -> bool:
        for data in writes:
            await stream.send_all(data)
        return not close
    return answer


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def test_the_request_leaves_in_one_write() -> None:
    server = Scripted(replying(OK))
    async with serving(server) as url:
        pool = UpstreamPool(url)
        response = await pool.request(b"POST", b"/v1/x", content=b'{"a": 1}',
                                      headers={"x-request-id": "r1"})
        assert await response.aread() == b"ok"
        await pool.aclose()
    (first,) = server.first_reads
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n") and first.endswith(b'\r\n\r\n{"a": 1}')
    assert b"\r\nx-request-id: r1\r\n" in first and b"\r\ncontent-length: 8\r\n" in first


async def test_chunks_one_read_completed_come_back_as_one_piece() -> None:
    gate = trio.Event()

    async def answer(stream: trio.abc.Stream) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                              b"6\r\ndata:1\r\n")
        await gate.wait()
        # Three events in one write, as when tokens piled up while the proxy was busy.
        await stream.send_all(b"6\r\ndata:2\r\n6\r\ndata:3\r\n6\r\ndata:4\r\n0\r\n\r\n")
        return True

    async with serving(Scripted(answer)) as url:
        pool = UpstreamPool(url)
        response = await pool.request(b"GET", b"/s")
        assert await response.receive() == b"data:1"
        gate.set()
        assert await response.receive() == b"data:2data:3data:4"
        assert await response.receive() == b""
        await response.aclose()
        assert len(pool._idle) == 1  # read to its end: kept
        await pool.aclose()


async def test_an_interim_response_is_skipped() -> None:
    server = Scripted(replying(b"HTTP/1.1 100 Continue\r\n\r\n", OK))
    async with serving(server) as url:
        pool = UpstreamPool(url)
        for _ in range(2):
            response = await pool.request(b"GET", b"/x")
            assert response.status == 200 and response.header("content-length") == "2"
            assert await response.aread() == b"ok"
        await pool.aclose()
    assert server.connections == 1


async def test_bytes_after_the_response_keep_the_body_but_not_the_connection() -> None:
    server = Scripted(replying(OK + b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx"))
    async with serving(server) as url:
        pool = UpstreamPool(url)
        assert await (await pool.request(b"GET", b"/x")).aread() == b"ok"
        assert pool._idle == []
        assert await (await pool.request(b"GET", b"/x")).aread() == b"ok"
        await pool.aclose()
    assert server.connections == 2


async def test_a_server_closing_mid_body_is_an_error_not_an_end() -> None:
    server = Scripted(replying(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
                               close=True))
    async with serving(server) as url:
        pool = UpstreamPool(url)
        response = await pool.request(b"GET", b"/x")
        assert await response.receive() == b"short"
        with pytest.raises(RemoteProtocolError, match="middle of the body"):
            await response.receive()
        await response.aclose()
        assert pool.limiter.borrowed_tokens == 0 and pool._idle == []
        await pool.aclose()


async def test_a_body_without_a_length_ends_when_the_server_closes() -> None:
    server = Scripted(replying(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it",
                               close=True))
    async with serving(server) as url:
        pool = UpstreamPool(url)
        assert await (await pool.request(b"GET", b"/x")).aread() == b"all of it"
        assert pool._idle == []
        await pool.aclose()


async def test_garbage_is_a_protocol_error() -> None:
    async with serving(Scripted(replying(b"SSH-2.0-OpenSSH_9.6\r\n", close=True))) as url:
        pool = UpstreamPool(url)
        with pytest.raises(RemoteProtocolError):
            await pool.request(b"GET", b"/x")
        assert pool.limiter.borrowed_tokens == 0
        await pool.aclose()


@pytest.mark.parametrize("headers", [{"x-request-id": "a\r\nx-data-parallel-rank: 0"},
                                     {"x-a\nb": "v"}, {"x-a": "v\0"}])
async def test_a_header_that_would_split_the_request_is_refused(headers: dict[str, str]) -> None:
    server = Scripted(replying(OK))
    async with serving(server) as url:
        pool = UpstreamPool(url, limit=1)
        with pytest.raises(LocalProtocolError):
            await pool.request(b"GET", b"/x", headers=headers)
        assert pool.limiter.borrowed_tokens == 0  # refused before a place was taken
        assert await (await pool.request(b"GET", b"/x")).aread() == b"ok"
        await pool.aclose()
    assert len(server.requests) == 1


async def test_a_port_nobody_listens_on_is_a_refused_connect() -> None:
    """The proxy evicts an instance at its first refused connection (``health``): the error
    must say "refused" only when nothing listens, not for every failed connect."""
    with socket.socket() as bound:  # holds a port, never listens: the kernel answers RST
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(ConnectRefused):
            await connect("127.0.0.1", bound.getsockname()[1], timeout=10)
    unreachable = OSError("all attempts to connect failed")
    unreachable.__cause__ = ExceptionGroup("attempts", [
        ConnectionRefusedError(111, "refused"), OSError(113, "no route to host")])
    assert not _all_refused(unreachable)  # one address of several refused: not proof enough
    refused = OSError("all attempts to connect failed")
    refused.__cause__ = ExceptionGroup("attempts", [ConnectionRefusedError(111, "refused")] * 2)
    assert _all_refused(refused)
    assert issubclass(ConnectRefused, ConnectError)  # still a connect failure everywhere else


def test_encode_request_refuses_what_it_cannot_frame() -> None:
    with pytest.raises(LocalProtocolError):
        encode_request(b"HEAD", b"/", [], b"")
    with pytest.raises(LocalProtocolError):
        encode_request(b"GET", b"/a b", [], b"")
    assert encode_request(b"GET", b"/", [(b"host", b"h")], b"") == b"GET / HTTP/1.1\r\nhost: h\r\n\r\n"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True)
    return cert, key


async def test_https_instances_work_with_the_trust_store(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:

    cert, key = certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # how an operator trusts a private CA
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    server = Scripted(replying(OK))

    async def handle(stream: trio.SocketStream) -> None:
        await server.handle(trio.SSLStream(stream, server_context, server_side=True))

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        pool = UpstreamPool(f"https://127.0.0.1:{listener.socket.getsockname()[1]}")
        for _ in range(2):
            assert await (await pool.request(b"GET", b"/x")).aread() == b"ok"
        await pool.aclose()
        nursery.cancel_scope.cancel()
    assert (len(server.requests), server.connections) == (2, 1)


# -- when a read tries before it waits (``_Plain.receive``) ---------------------------------------
class _CountingSocket(socket.socket):
    """A socket that counts its ``recv`` calls and the ones that found nothing."""

    calls = 0
    empty = 0

    def recv(self, size: int, *args: int) -> bytes:  # type: ignore[override]
        self.calls += 1
        try:
            return super().recv(size, *args)
        except BlockingIOError:
            self.empty += 1
            raise


async def test_a_slow_peer_is_waited_for_before_reading_and_a_fast_one_is_read_at_once() -> None:
    from epd_trio._upstream import h1

    ours, theirs = socket.socketpair()
    counting = _CountingSocket(fileno=ours.detach())
    counting.setblocking(False)
    plain = h1._Plain(counting)
    with counting, theirs:
        theirs.send(b"a")
        assert await plain.receive() == b"a"  # there already: one read, no wait
        assert (counting.calls, counting.empty) == (1, 0)

        async def slow(data: bytes) -> bytes:
            """Read ``data`` sent only once the reader is blocked (a peer slower than us)."""
            async with trio.open_nursery() as nursery:
                async def send_later() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    theirs.send(data)
                nursery.start_soon(send_later)
                return await plain.receive()

        assert await slow(b"b") == b"b"  # tried first, found nothing, waited
        assert (counting.calls, counting.empty) == (3, 1)
        for n in range(h1._PROBE_EVERY - 1):  # from then on it waits first: no empty read
            assert await slow(b"c%d" % n) == b"c%d" % n
        assert counting.empty == 1
        assert await slow(b"d") == b"d"  # one in _PROBE_EVERY tries first again
        assert counting.empty == 2
        for _ in range(h1._PROBE_EVERY - 1):
            await slow(b"e")
        theirs.send(b"f")  # the probe finds the bytes there: it reads at once again...
        calls = counting.calls
        assert await plain.receive() == b"f"
        theirs.send(b"g")
        assert await plain.receive() == b"g"  # ...and goes on reading first
        assert (counting.calls - calls, counting.empty) == (2, 2)
