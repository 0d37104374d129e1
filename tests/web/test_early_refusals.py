"""Refusals before the pipeline, over real sockets: each has an id, a log line and a metric,
and a body the proxy refuses unread is never asked for with ``100 Continue`` (issue 31)."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
import trio.testing

from epd_trio.testing import run_cluster

from helpers import CHAT, chat_body, metric

LIMIT = 1000


def request_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str, int]]:
    """The request lines logged: (id, endpoint, outcome, status) from their fields."""
    return [(f["request_id"], f["endpoint"], f["outcome"], f["status"])
            for r in caplog.records if r.name == "epd_trio.requests"
            for f in [r.fields]]  # type: ignore[attr-defined]


async def read_response(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    seen = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some():
            seen += chunk
    return seen


async def test_each_early_refusal_has_an_id_a_log_line_and_a_metric(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_trio.requests")
    async with run_cluster(decodes=1, api_keys=("k",), max_body_bytes=LIMIT,
                           request_log=True) as c:
        key = {"authorization": "Bearer k"}
        cases = [
            ("no-key", "POST", {}, chat_body(), 401),
            ("too-big", "POST", key, {"model": "m", "pad": "x" * LIMIT}, 413),
            ("get", "GET", key, None, 405),
        ]
        for rid, method, headers, body, status in cases:
            r = await client.request(method, c.proxy_url + CHAT, json=body,
                                     headers={**headers, "x-request-id": rid})
            assert r.status_code == status, r.text
            assert r.headers["x-request-id"] == rid
            assert r.json()["error"]["message"]
        r = await client.post(c.proxy_url + CHAT, content=b"{", headers=key)
        assert r.status_code == 400 and r.headers["x-request-id"]  # an id of the proxy's
        await trio.testing.wait_all_tasks_blocked()  # its line is written once it is sent
        lines = request_lines(caplog)
        assert lines == [(rid, CHAT, "client_error", status) for rid, *_, status in cases] + [
            (r.headers["x-request-id"], CHAT, "client_error", 400)]
        assert metric(c.proxy, "epd_trio_requests_total", endpoint=CHAT,
                      outcome="client_error") == 4


async def test_a_declared_length_over_the_limit_gets_413_and_no_100_continue() -> None:
    """The client waits for ``100 Continue`` before sending its body: it gets the 413 (with
    its id, closing the connection) instead, and never sends the body."""
    async with run_cluster(decodes=1, max_body_bytes=LIMIT) as c:
        host, port = c.proxy_url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {LIMIT + 1}\r\nexpect: 100-continue\r\n"
                "x-request-id: big\r\n\r\n".encode())
            answer = await read_response(stream)
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        assert b" 100 " not in answer.split(b"\r\n\r\n")[0]
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert b"\r\nx-request-id: big" in head and b"\r\nconnection: close" in head


async def test_100_continue_still_comes_when_the_body_is_read() -> None:
    async with run_cluster(decodes=1, max_body_bytes=LIMIT) as c:
        host, port = c.proxy_url.removeprefix("http://").split(":")
        body = httpx.Request("POST", "http://x", json=chat_body()).read()
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nexpect: 100-continue\r\n"
                "connection: close\r\n\r\n".encode())
            seen = b""
            with trio.fail_after(10):
                while b"\r\n\r\n" not in seen:
                    seen += await stream.receive_some()
            assert seen.startswith(b"HTTP/1.1 100 "), seen
            await stream.send_all(body)
            answer = seen + await read_response(stream)
        assert b"\r\n\r\nHTTP/1.1 200 " in answer, answer


async def test_a_client_that_leaves_before_its_body_ends_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="epd_trio.requests")
    async with run_cluster(decodes=1, request_log=True) as c:
        host, port = c.proxy_url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
                                  "x-request-id: gone\r\n\r\n{".encode())
            await trio.testing.wait_all_tasks_blocked()  # the proxy reads the body: wait
        await trio.testing.wait_all_tasks_blocked()  # it sees the close
        assert request_lines(caplog) == [("gone", CHAT, "cancelled", 499)]
        assert metric(c.proxy, "epd_trio_requests_total", endpoint=CHAT,
                      outcome="cancelled") == 1


async def test_refusals_of_the_other_routes_have_an_id_a_log_line_and_a_metric(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The Quart routes (models, admin, unknown paths) answer with an id too, and each refusal
    is logged and counted like a completion's; an unknown path counts as ``other``."""
    caplog.set_level(logging.INFO, logger="epd_trio.requests")
    async with run_cluster(decodes=1, api_keys=("k",), admin_key="admin",
                           request_log=True) as c:
        cases = [
            ("models-no-key", "GET", "/v1/models", {}, 401, "/v1/models"),
            ("admin-bad-key", "GET", "/instances", {"x-api-key": "nope"}, 401, "/instances"),
            ("unknown", "GET", "/v1/nope", {}, 404, "other"),
            ("wrong-method", "DELETE", "/health", {}, 405, "/health"),
        ]
        for rid, method, path, headers, status, _ in cases:
            r = await client.request(method, c.proxy_url + path,
                                     headers={**headers, "x-request-id": rid})
            assert r.status_code == status, r.text
            assert r.headers["x-request-id"] == rid
            assert r.json()["error"]["message"]
        r = await client.get(c.proxy_url + "/health")
        assert r.status_code == 200 and r.headers["x-request-id"]  # answers carry one too
        await trio.testing.wait_all_tasks_blocked()
        assert request_lines(caplog) == [(rid, endpoint, "client_error", status)
                                         for rid, _, _, _, status, endpoint in cases]
        for _, _, _, _, _, endpoint in cases:
            assert metric(c.proxy, "epd_trio_requests_total", endpoint=endpoint,
                          outcome="client_error") == 1
