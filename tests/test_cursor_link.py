"""The global cursor's lean RESP link: its parser, and pipelining against a real redis-server."""

from __future__ import annotations

import pytest
import trio

from epd_trio._core.state_url import parse_state_url
from epd_trio._cursor_link import CursorLink, LinkBroken, command, parse_replies

from real_servers import RedisServer


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


@pytest.mark.parametrize("reply", [b"-WRONGTYPE Operation against a key\r\n", b"$3\r\nabc\r\n",
                                   b":12x\r\n", b"*1\r\n"])
def test_anything_but_an_integer_or_status_breaks_the_link(reply: bytes) -> None:
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


async def test_an_error_reply_breaks_the_link_and_releases_the_callers(
    redis_server: RedisServer,
) -> None:
    redis_server.command("HSET", "cl:test:hash", "a", "1")
    link = await CursorLink.open(parse_state_url(redis_server.url))
    with pytest.raises(ExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            with pytest.raises(LinkBroken):
                await link.incrby(b"cl:test:hash", 1)
    assert info.group_contains(LinkBroken, match="WRONGTYPE")
    with pytest.raises(LinkBroken):
        await link.incrby(b"cl:test:other", 1)  # broken for good: the owner reconnects


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
