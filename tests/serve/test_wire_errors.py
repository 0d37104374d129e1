"""What a client reads on the wire when it is refused: an OpenAI error body with the status and
its reason phrase, whether the route, the app or Hypercorn's HTTP parser refused it (issue 31,
item 8). Raw bytes over a real socket to the proxy served in-process on ``epd-trio serve``'s
connection class: the status line and Hypercorn's own answers are below any HTTP client."""

from __future__ import annotations

import orjson
import pytest
import trio

from epd_trio.testing import run_cluster

#: Ceiling for a read that only fails when something hangs.
GUARD = 10.0


async def exchange(url: str, request: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Send ``request`` (which closes the connection after it, or is refused so) and read the
    whole answer: its status line, its headers (lower-cased names) and its body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    answer = b""
    with trio.fail_after(GUARD):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(request)
            while chunk := await stream.receive_some():
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = {name.strip().lower(): value.strip()
               for name, _, value in (line.partition(b":") for line in lines)}
    return status_line, headers, body


def error_of(headers: dict[bytes, bytes], body: bytes) -> dict[str, object]:
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body)
    error = orjson.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


CLOSE = b"host: x\r\nconnection: close\r\n"


@pytest.mark.parametrize(("request_bytes", "status_line", "message", "allow"), [
    (b"GET /v1/nope HTTP/1.1\r\n" + CLOSE + b"\r\n", b"HTTP/1.1 404 Not Found",
     "Invalid URL (GET /v1/nope)", None),
    (b"DELETE /v1/models HTTP/1.1\r\n" + CLOSE + b"\r\n", b"HTTP/1.1 405 Method Not Allowed",
     "method DELETE is not allowed on /v1/models", b"GET"),
], ids=["404", "405"])
async def test_unknown_routes_and_methods_answer_openai_errors(
    request_bytes: bytes, status_line: bytes, message: str, allow: bytes | None
) -> None:
    async with run_cluster(decodes=1) as c:
        line, headers, body = await exchange(c.proxy_url, request_bytes)
    assert line == status_line
    error = error_of(headers, body)
    assert str(error["message"]).startswith(message) and "URL manually" not in body.decode()
    assert error["code"] == int(status_line.split()[1])
    if allow is not None:
        assert allow in headers[b"allow"].replace(b" ", b"").split(b",")


@pytest.mark.parametrize(("request_bytes", "status_line", "fragment"), [
    (b"GET /health HTTP/1.1\r\nhost x\r\n\r\n", b"HTTP/1.1 400 Bad Request", "not valid HTTP"),
    (b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n",
     b"HTTP/1.1 431 Request Header Fields Too Large", "larger than the limit of 16384 bytes"),
], ids=["400", "431"])
async def test_hypercorns_own_refusals_carry_a_json_body(
    request_bytes: bytes, status_line: bytes, fragment: str
) -> None:
    async with run_cluster(decodes=1) as c:
        line, headers, body = await exchange(c.proxy_url, request_bytes)
    assert line == status_line
    error = error_of(headers, body)
    assert fragment in str(error["message"]) and error["code"] == int(status_line.split()[1])
    assert error["type"] == "invalid_request_error"
    assert headers[b"connection"] == b"close"


async def test_status_lines_carry_their_reason_phrase() -> None:
    async with run_cluster(decodes=1) as c:
        ok, _, _ = await exchange(c.proxy_url, b"GET /health HTTP/1.1\r\n" + CLOSE + b"\r\n")
        bad, headers, body = await exchange(
            c.proxy_url, b"POST /v1/chat/completions HTTP/1.1\r\n" + CLOSE
            + b"content-type: application/json\r\ncontent-length: 3\r\n\r\n{\xff}")
        streamed, _, _ = await exchange(
            c.proxy_url, b"POST /v1/completions HTTP/1.1\r\n" + CLOSE
            + b"content-length: 55\r\n\r\n"
            + b'{"model": "fake-model", "prompt": "hi", "stream": true}'.ljust(55))
    assert ok == b"HTTP/1.1 200 OK"
    assert streamed == b"HTTP/1.1 200 OK"  # a chunked stream's head too
    assert bad == b"HTTP/1.1 400 Bad Request"
    # The 0xFF byte is named, not orjson's "str is not valid UTF-8: surrogates not allowed".
    assert error_of(headers, body)["message"] == ("request body is not valid UTF-8: byte 0xff "
                                                  "at offset 1")
