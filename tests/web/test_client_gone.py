"""``ClientGone``: a connection's news to its HTTP/1.x requests that their client left."""

from __future__ import annotations

import pytest
import trio

from epd_trio._web.client_gone import CLIENT_GONE, ClientGone, client_gone


async def test_it_cancels_the_requests_registered_when_the_client_leaves() -> None:
    gone = ClientGone()
    first, second, done = trio.CancelScope(), trio.CancelScope(), trio.CancelScope()
    with gone.cancelling(done):
        pass  # a request that ended before the client left is forgotten
    with gone.cancelling(first), gone.cancelling(second):
        assert not (first.cancel_called or second.cancel_called)
        gone.left()
        assert first.cancel_called and second.cancel_called
    assert not done.cancel_called


async def test_a_request_registered_after_the_client_left_is_cancelled_at_once() -> None:
    gone = ClientGone()
    gone.left()
    late = trio.CancelScope()
    with gone.cancelling(late):
        assert late.cancel_called


@pytest.mark.parametrize(("http_version", "offered", "answer"), [
    ("1.1", True, True), ("1.0", True, True),
    ("2", True, False),   # a stream ends without its connection: the watcher hears it
    ("1.1", False, False),  # plain Hypercorn offers nothing
])
def test_only_an_http1_request_of_a_connection_that_offers_it_gets_it(
    http_version: str, offered: bool, answer: bool
) -> None:
    gone = ClientGone()
    state = {CLIENT_GONE: gone} if offered else {}
    assert (client_gone({"http_version": http_version, "state": state}) is gone) is answer
    assert client_gone({"http_version": http_version}) is None  # a server without ASGI state
