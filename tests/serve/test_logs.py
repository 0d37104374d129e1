"""Logs: the per-request line (off by default), its JSON form, and the level/format settings."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
import trio.testing

from epd_trio._core.errors import (
    BadRequest,
    ProxyOverloaded,
    RateLimited,
    UpstreamStatusError,
    UpstreamTimeout,
)
from epd_trio._core.errors import UpstreamTransportError as Transport
from epd_trio._core.trace import (
    Attempt,
    RequestTrace,
    layout_of,
    outcome_of,
    request_fields,
    text_value,
)
from epd_trio._serve.logs import JsonFormatter, TextFormatter, configure_logging
from epd_trio.testing import FakeVLLM, run_cluster
from epd_trio.testing.process import read_until, stop_process

from helpers import CHAT, SERVING, chat_body, image, start_fakes

#: Ceiling for waits that only fail when something hangs.
GUARD = 30.0
#: Client threads that close as soon as they have read an answer.
CLOSERS = 8


# -- pure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("error", "outcome"), [
    (BadRequest("bad"), "client_error"),
    (UpstreamStatusError(stage="decode", instance="d", upstream_status=400, upstream_body=b""),
     "client_error"),
    (UpstreamStatusError(stage="decode", instance="d", upstream_status=503, upstream_body=b""),
     "upstream_error"),
    (Transport("refused", stage="prefill", instance="p"), "upstream_error"),
    (UpstreamTimeout("slow", stage="encode", instance="e"), "timeout"),
    (ProxyOverloaded("full"), "overloaded"),
    (RateLimited("batch", "requests_per_minute", 10, 6), "rate_limited"),
    (RateLimited("batch", "max_inflight", 2, 1), "rate_limited"),
])
def test_outcome_of_errors(error: Exception, outcome: str) -> None:
    assert outcome_of(error) == outcome  # type: ignore[arg-type]


def _trace() -> RequestTrace:
    trace = RequestTrace("r1", CHAT, started=100.0, stream=True)
    trace.attempts = [
        Attempt("encode", "http://e0", None, 100.001, 0.004, "ok"),
        Attempt("encode", "http://e1", None, 100.002, 0.006, "ok"),
        Attempt("prefill", "http://p0", 1, 100.010, 0.020, "ok"),
        Attempt("decode", "http://d0", 0, 100.031, 0.002, "error"),
        Attempt("decode", "http://d1", 3, 100.040, 0.005, "ok"),
    ]
    trace.retries, trace.first_byte, trace.kv_missing = 1, 100.045, True
    return trace


def test_request_fields() -> None:
    fields = request_fields(_trace(), 100.5)
    assert fields["request_id"] == "r1" and fields["endpoint"] == CHAT and fields["stream"]
    assert fields["layout"] == "E+P+D" and fields["outcome"] == "ok" and fields["status"] == 200
    assert fields["duration_s"] == 0.5 and fields["ttfb_s"] == 0.045
    assert fields["stages_s"] == {"encode": 0.007, "prefill": 0.02, "decode": 0.014}
    assert [(a["stage"], a["instance"], a["rank"], a["outcome"]) for a in fields["attempts"]] == [
        ("encode", "http://e0", None, "ok"), ("encode", "http://e1", None, "ok"),
        ("prefill", "http://p0", 1, "ok"), ("decode", "http://d0", 0, "error"),
        ("decode", "http://d1", 3, "ok")]
    assert fields["attempts"][2]["start_s"] == 0.01 and fields["attempts"][2]["seconds"] == 0.02
    assert fields["retries"] == 1 and fields["kv_transfer_params_missing"] is True
    assert "error" not in fields and "cancelled_stage" not in fields
    json.dumps(fields)  # JSON-ready as is


def test_layout_is_what_the_request_ran() -> None:
    def ran(*stages: str) -> RequestTrace:
        return RequestTrace("r", CHAT, 0.0, attempts=[
            Attempt(stage, f"http://{stage}", None, 0.0) for stage in stages])

    assert layout_of(_trace()) == "E+P+D"
    assert layout_of(ran("prefill", "decode")) == "P+D"  # text on an E+P+D proxy
    assert layout_of(ran("encode", "decode")) == "E+PD"
    assert layout_of(ran("decode")) == "PD"
    assert layout_of(ran()) is None  # refused before reaching an instance


# -- formatting and configuration ---------------------------------------------------------------
def _record(level: int = logging.INFO, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord("epd_trio.requests", level, __file__, 1, "req %s", ("r1",), None)
    record.fields = fields
    return record


def test_json_and_text_formats() -> None:
    line = JsonFormatter().format(_record(request_id="r1", stages_s={"decode": 0.5}))
    parsed = json.loads(line)
    assert parsed["message"] == "req r1" and parsed["level"] == "INFO"
    assert parsed["logger"] == "epd_trio.requests" and parsed["time"].endswith("+00:00")
    assert parsed["request_id"] == "r1" and parsed["stages_s"] == {"decode": 0.5}
    text = TextFormatter().format(_record(request_id="r1", error="HTTP 500: boom"))
    assert text.endswith(' INFO epd_trio.requests: req r1 request_id=r1 error="HTTP 500: boom"')


def test_text_lines_cannot_be_forged_by_an_upstream_message() -> None:
    """An upstream error text quoted in a message or a field stays on its one line."""
    record = logging.LogRecord("epd_trio", logging.WARNING, __file__, 1, "failed: %s",
                               ("boom\n2026-01-01 INFO epd_trio: all good",), None)
    record.fields = {"upstream": "x\ny"}
    text = TextFormatter().format(record)
    assert "\n" not in text
    assert text.endswith('failed: boom\\n2026-01-01 INFO epd_trio: all good upstream="x\\ny"')


@pytest.fixture
def restore_logging() -> Iterator[None]:
    logger = logging.getLogger("epd_trio")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved  # type: ignore[assignment]


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_sets_level_and_format() -> None:
    out = io.StringIO()
    configure_logging("WARNING", "json", stream=out)
    configure_logging("WARNING", "json", stream=out)  # idempotent: one handler
    logging.getLogger("epd_trio.requests").info("hidden")
    logging.getLogger("epd_trio").warning("shown %d", 1, extra={"fields": {"instance": "x"}})
    lines = out.getvalue().splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["shown 1"]
    assert json.loads(lines[0])["instance"] == "x"
    assert logging.getLogger("httpx2").level == logging.NOTSET  # other loggers untouched


# -- through the proxy --------------------------------------------------------------------------
async def test_one_json_line_per_request_when_enabled(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_trio")
    async with run_cluster(encoders=2, prefills=1, prefill_dp=2, decodes=2, decode_dp=2,
                           request_log=True) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1), image(2), stream=True),
                              headers={"x-request-id": "log-1"})
        assert r.status_code == 200
        await trio.testing.wait_all_tasks_blocked()  # logged as its resources close
    records = [r for r in caplog.records if r.name == "epd_trio.requests"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "log-1" and line["layout"] == "E+P+D"
    assert line["outcome"] == "ok" and line["status"] == 200 and line["stream"] is True
    # Instances and ranks: exactly where the legs went.
    seen = sorted((role, f.url, x.rank) for role, fakes in (
        ("encode", c.encoders), ("prefill", c.prefills), ("decode", c.decodes))
        for f in fakes for x in f.requests() if x.request_id.startswith("log-1"))
    assert sorted((a["stage"], a["instance"], a["rank"]) for a in line["attempts"]) == seen
    assert len(seen) == 4 and all(a["outcome"] == "ok" for a in line["attempts"])
    assert set(line["stages_s"]) == {"encode", "prefill", "decode"}
    assert 0 < line["ttfb_s"] <= line["duration_s"]
    assert line["message"].startswith("log-1 /v1/chat/completions ok 200 in ")


@pytest.mark.parametrize(("value", "written"), [
    ("log-1", "log-1"),
    ("a b", '"a b"'),
    ('x" outcome=ok', '"x\\" outcome=ok"'),
    ("id=7", '"id=7"'),
    ("", '""'),
    (3, "3"),
])
def test_text_values_are_one_token(value: object, written: str) -> None:
    assert text_value(value) == written


async def test_a_clients_request_id_is_quoted_in_the_text_line(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The client chooses its ``x-request-id``: one holding spaces, a quote and ``key=value``
    must not forge words or fields of the request line (issue 31, item 10)."""
    caplog.set_level(logging.INFO, logger="epd_trio")
    forged = 'x" outcome=ok status=200 y'
    async with run_cluster(decodes=1, request_log=True) as c:
        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={"x-request-id": forged})
        assert r.status_code == 200 and r.headers["x-request-id"] == forged
        await trio.testing.wait_all_tasks_blocked()  # logged as its resources close
    [record] = [r for r in caplog.records if r.name == "epd_trio.requests"]
    text = TextFormatter().format(record)
    quoted = json.dumps(forged)
    assert f"epd_trio.requests: {quoted} /v1/chat/completions ok 200 in " in text
    assert f" request_id={quoted} " in text


async def test_failed_request_line_names_the_error(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_trio")
    async with run_cluster(prefills=1, decodes=1, request_log=True, decode_retries=0) as c:
        c.decodes[0].behaviour.fail_status = 500
        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={"x-request-id": "log-2"})
        assert r.status_code == 502
        await trio.testing.wait_all_tasks_blocked()
    (record,) = [r for r in caplog.records if r.name == "epd_trio.requests"]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["outcome"] == "upstream_error" and fields["status"] == 502
    assert fields["layout"] == "P+D" and "decode stage failed" in fields["error"]
    assert [a["outcome"] for a in fields["attempts"]] == ["ok", "error"]


async def test_nothing_is_logged_per_request_by_default(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="epd_trio")
    async with run_cluster(encoders=1, prefills=1, decodes=1) as c:
        caplog.clear()  # start-up said what each instance serves: once, not per request
        for stream in (False, True):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(image(1), stream=stream))
            assert r.status_code == 200
        assert (await client.post(c.proxy_url + CHAT, content=b"{")).status_code == 400
        await trio.testing.wait_all_tasks_blocked()
    assert [r for r in caplog.records if r.name.startswith("epd_trio")] == []


# -- one stream, one format (issue 31, item 7): the real ``epd-trio serve`` ----------------------
async def _serve_output(nursery: trio.Nursery, *args: str,
                        drive: Callable[[str], Awaitable[None]]) -> tuple[bytes, list[dict]]:
    """Run ``epd-trio serve ARGS`` (admin key "k"), ``drive`` it by its URL, SIGTERM it, and
    return its whole stdout and its stderr lines, each parsed as JSON (which fails on any
    line that is not)."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "epd_trio", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "EPD_ADMIN_KEY": "k"})
    try:
        assert process.stderr is not None and process.stdout is not None
        match, seen = await read_until(process.stderr, SERVING)
        url = match.group(1).decode()
        await drive(url)
        process.terminate()
        err, out = seen, b""
        with trio.fail_after(GUARD):
            while chunk := await process.stderr.receive_some():
                err += chunk
            while chunk := await process.stdout.receive_some():
                out += chunk
            assert await process.wait() == 0
    finally:
        await stop_process(process)
    return out, [json.loads(line) for line in err.decode().splitlines()]


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_json_logs_are_every_line_on_one_stream(nursery: trio.Nursery, workers: str) -> None:
    decode, joining = FakeVLLM("prefill_decode"), FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode, joining)
    closes = 8 * CLOSERS

    async def drive(url: str) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=GUARD) as client:
            assert (await client.post(url + CHAT, json=chat_body(),
                                      headers={"x-request-id": "a1"})).status_code == 200
            assert (await client.get(url + "/nope")).status_code == 404
            registered = await client.post(url + "/instances", headers={"x-api-key": "k"},
                                           json={"role": "prefill_decode",
                                                 "url": joining.url})
            assert registered.status_code == 200, registered.text
        # Clients that close as soon as they have read their answer: the end of file races the
        # end of the response, which Hypercorn logged twice (once with status "-").
        host, port = url.removeprefix("http://").rsplit(":", 1)

        def read_and_close() -> None:  # a blocking client, in threads: the tightest close
            for _ in range(closes // CLOSERS):
                with socket.create_connection((host, int(port)), timeout=GUARD) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                    answer = b""
                    while not answer.endswith(b"}"):
                        answer += sock.recv(65536)

        async with trio.open_nursery() as clients:
            for _ in range(CLOSERS):
                clients.start_soon(trio.to_thread.run_sync, read_and_close)

    out, lines = await _serve_output(nursery, "--decode", decode.url, "--log-format", "json",
                                     "--access-log", "--request-log", "--workers", workers,
                                     drive=drive)
    assert out == b""  # nothing on stdout: the access log too is on stderr
    by_logger: dict[str, list[dict]] = {}
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line), line
        by_logger.setdefault(line["logger"], []).append(line)
    # Hypercorn's start line, and the serve command's own lines, in the same format.
    assert sum(x["message"].startswith("Running on http://")
               for x in by_logger["epd_trio.server"]) == int(workers)  # one per worker
    assert [x["message"].split(":")[0] for x in by_logger["epd_trio.serve"]][-1] == "SIGTERM"
    # One access line per request, each with its status.
    access = by_logger["epd_trio.access"]
    assert sorted((x["method"], x["path"]) for x in access) == sorted(
        [("POST", CHAT), ("GET", "/nope"), ("POST", "/instances")] + [("GET", "/health")] * closes)
    assert all(isinstance(x["status"], int) for x in access)
    assert next(x for x in access if x["path"] == CHAT)["request_id"] == "a1"
    # A registration is news, not a warning.
    [registered] = [x for x in by_logger["epd_trio"] if "registered" in x["message"]]
    assert registered["level"] == "INFO"


def test_an_uncaught_exception_is_a_json_line() -> None:
    """A warning, or a traceback that reaches the top of a serve process, is a record in its
    format too."""
    code = ("from epd_trio._serve.logs import capture_process_output, configure_logging\n"
            "configure_logging('INFO', 'json')\ncapture_process_output('INFO')\n"
            "import threading, warnings\nwarnings.warn('careful', UserWarning)\n"
            "t = threading.Thread(target=lambda: 1 / 0, name='side'); t.start(); t.join()\n"
            "raise RuntimeError('boom')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=GUARD)
    assert done.returncode == 1 and done.stdout == b""
    lines = [json.loads(line) for line in done.stderr.decode().splitlines()]
    warned, *crashed = lines
    assert warned["level"] == "WARNING" and "UserWarning: careful" in warned["message"]
    assert [(x["level"], x["message"]) for x in crashed] == [
        ("CRITICAL", "uncaught ZeroDivisionError in thread side: division by zero"),
        ("CRITICAL", "uncaught RuntimeError: boom")]
    assert all("Traceback" in x["exception"] for x in crashed)
