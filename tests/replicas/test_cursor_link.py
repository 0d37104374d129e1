"""The global cursor's lean RESP link: its parser, and pipelining against a real redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from epd_trio._core.state_url import parse_state_url
from epd_trio._replicas.cursor_link import CommandRefused, CursorLink, LinkBroken, command, parse_replies
from epd_trio._replicas.sync import redis_client

from real_servers import RedisServer, tls_redis_server


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert command(b"INCRBY", b"epd:cursor:decode", b"3") == (
        b"*3\r\n$6\r\nINCRBY\r\n$17\r\nepd:cursor:decode\r\n$1\r\n3\r\n")


def test_replies_are_taken_whole_and_in_order_from_any_pieces() -> None:
    stream = b":1\r\n+OK\r\n:-42\r\n:1234567890123\r\n"
    for cut in range(len(stream) + 1):
        buffer = bytearray(stream[:cut])
        got = parse_replies(buffer)
        buffer += stream[cut:]
        got += parse_replies(buffer)
        assert got == [1, b"OK", -42, 1234567890123] and not buffer


def test_an_error_reply_is_that_commands_answer() -> None:
    buffer = bytearray(b"-WRONGTYPE Operation against a key\r\n:5\r\n")
    refused, five = parse_replies(buffer)
    assert isinstance(refused, CommandRefused) and "WRONGTYPE" in str(refused) and five == 5


def test_an_array_of_integers_is_taken_whole() -> None:
    stream = b"*2\r\n:1\r\n:-250\r\n*0\r\n:7\r\n"
    for cut in range(len(stream) + 1):
        buffer = bytearray(stream[:cut])
        got = parse_replies(buffer)
        buffer += stream[cut:]
        got += parse_replies(buffer)
        assert got == [[1, -250], [], 7] and not buffer


@pytest.mark.parametrize("reply", [b"$3\r\nabc\r\n", b":12x\r\n", b"*1\r\n+OK\r\n",
                                   b"*-1\r\n"])
def test_anything_but_an_integer_a_status_or_an_error_breaks_the_link(reply: bytes) -> None:
    with pytest.raises(LinkBroken):
        parse_replies(bytearray(reply))


async def test_a_thousand_concurrent_increments_are_pipelined_and_exact(
    redis_server: RedisServer,
) -> None:
    async with trio.open_nursery() as nursery:
        link = await CursorLink.open(parse_state_url(redis_server.url))
        await nursery.start(link.run)
        got: list[int] = []

        async def one() -> None:
            got.append(await link.incrby(b"cl:test:counter", 2))

        async with trio.open_nursery() as callers:
            for _ in range(1000):
                callers.start_soon(one)
        assert sorted(got) == list(range(2, 2001, 2))  # every value once: no reply misrouted
        nursery.cancel_scope.cancel()


async def test_an_error_reply_fails_its_call_and_the_link_goes_on(
    redis_server: RedisServer,
) -> None:
    redis_server.command("HSET", "cl:test:hash", "a", "1")
    redis_server.command("SET", "cl:test:text", "not a number")
    async with trio.open_nursery() as nursery:
        link = await CursorLink.open(parse_state_url(redis_server.url))
        await nursery.start(link.run)
        got: dict[bytes, object] = {}

        async def one(key: bytes) -> None:
            try:
                got[key] = await link.incrby(key, 1)
            except CommandRefused as exc:
                got[key] = str(exc)

        async with trio.open_nursery() as callers:  # pipelined together: replies stay aligned
            for key in (b"cl:test:hash", b"cl:test:fine", b"cl:test:text", b"cl:test:fine2"):
                callers.start_soon(one, key)
        assert "WRONGTYPE" in str(got[b"cl:test:hash"])
        assert "not an integer" in str(got[b"cl:test:text"])
        assert got[b"cl:test:fine"] == 1 and got[b"cl:test:fine2"] == 1
        assert await link.incrby(b"cl:test:fine", 1) == 2
        nursery.cancel_scope.cancel()


async def test_a_refused_greeting_breaks_the_link(redis_server: RedisServer) -> None:
    url = parse_state_url(f"redis://:wrong@127.0.0.1:{redis_server.port}/0")
    with pytest.raises(LinkBroken, match="AUTH"):
        await CursorLink.open(url)


async def test_a_caller_that_gives_up_leaves_the_replies_aligned(redis_server: RedisServer) -> None:
    async with trio.open_nursery() as nursery:
        link = await CursorLink.open(parse_state_url(redis_server.url))
        await nursery.start(link.run)
        with trio.move_on_after(0):  # gives up before its reply: the reply is dropped
            await link.incrby(b"cl:test:aligned", 1)
        got = []

        async def one(key: bytes) -> None:
            got.append((key, await link.incrby(key, 10)))

        async with trio.open_nursery() as callers:
            callers.start_soon(one, b"cl:test:aligned")
            callers.start_soon(one, b"cl:test:other")
        assert sorted(got) == [(b"cl:test:aligned", 11), (b"cl:test:other", 10)]
        nursery.cancel_scope.cancel()


async def test_without_a_context_both_links_trust_the_urls_own_ca(tmp_path: Path) -> None:
    """One rule for both connections: given no context, a ``rediss://`` URL's ``ssl_ca_certs``
    is used (``_state_tls.tls_context``), not the system's authorities, which refuse the
    private CA of this server."""
    redis = tls_redis_server(tmp_path)
    try:
        url = parse_state_url(redis.url)
        assert url.tls and url.ca_certs is not None
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                link = await CursorLink.open(url)
                await nursery.start(link.run)
                assert await link.incrby(b"cl:test:tls", 3) == 3
                nursery.cancel_scope.cancel()
            async with redis_client(url, 5.0, "cl-test") as client:
                assert await client.incrby("cl:test:tls", 1) == 4
    finally:
        redis.kill()
