"""``epd-trio serve``: flags, worker processes sharing their cursors, bounded shutdown."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
import trio

from epd_trio._serve.process import auto_workers
from epd_trio._serve.runner import cannot_make_metrics_dir
from epd_trio.testing import FakeVLLM
from epd_trio.testing.moriio import MoriioStandIn
from epd_trio.testing.ports import free_port
from epd_trio.testing.process import read_until, read_url

from helpers import (
    CHAT,
    SERVING,
    Samples,
    chat_body,
    image,
    moriio_pair,
    open_stuck_stream,
    poll_until,
    requests_per_worker,
    scrape,
    start_fakes,
)

SERVE = [sys.executable, "-m", "epd_trio", "serve", "--port", "0"]


@asynccontextmanager
async def serving(
    *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[trio.Process, str]]:
    process = await trio.lowlevel.open_process(
        [*SERVE, *args], stderr=subprocess.PIPE,
        env={**os.environ, **env} if env is not None else None)
    try:
        assert process.stderr is not None
        url = await read_url(process.stderr, SERVING)
        try:
            yield process, url
        except BaseException:
            await _print_what_it_said(process)
            raise
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _print_what_it_said(process: trio.Process) -> None:
    """When a test fails, its server's exit status and the rest of its stderr (the workers'
    too): pytest shows them beside the failure, so a failure on a CI machine names its cause."""
    status = process.returncode  # None: still running when the test failed
    said = bytearray()
    with trio.CancelScope(shield=True):
        if status is None:
            process.kill()
        await process.wait()
        assert process.stderr is not None
        with trio.move_on_after(5):  # orphaned workers hold the pipe until their lifeline ends
            async for chunk in process.stderr:
                said.extend(chunk)
    print(f"\nserve's exit status when the test failed: {status}; the rest of its stderr:\n"
          f"{said.decode(errors='replace')}")


async def test_flags_configure_the_proxy_and_sigterm_stops_it(nursery: trio.Nursery) -> None:
    enc = [FakeVLLM("encode") for _ in range(2)]
    prefill, decode = FakeVLLM("prefill", dp_size=2), FakeVLLM("decode", dp_size=2)
    await start_fakes(nursery, *enc, prefill, decode)
    async with serving("--encode", enc[0].url, enc[1].url, "--prefill", f"{prefill.url}#dp=2",
                       "--decode", f"{decode.url}#dp=2", "--encoder-max-batch", "1",
                       "--graceful-timeout", "1", "--no-metrics") as (process, url):
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            for n in range(2):
                r = await client.post(url + "/v1/chat/completions",
                                      json=chat_body(image(2 * n), image(2 * n + 1)))
                assert r.status_code == 200
        assert [len(e.requests()) for e in enc] == [2, 2]  # batch 1: one sub-request per item
        assert sorted(x.rank for x in decode.requests()) == [0, 1]
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            assert (await client.get(url + "/metrics")).status_code == 404  # --no-metrics
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(6):
            assert await process.wait() == 0


async def test_request_log_flags_give_json_lines_on_stderr(nursery: trio.Nursery) -> None:
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode)
    async with serving("--decode", decode.url, "--request-log", "--log-format",
                       "json") as (process, url):
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            r = await client.post(url + CHAT, json=chat_body(), headers={"x-request-id": "j1"})
            assert r.status_code == 200
        assert process.stderr is not None
        # The line may be the first thing read after the "listening" line: no newline before it.
        match, _ = await read_until(process.stderr, rb"(?:^|\n)(\{[^\n]*\"j1\"[^\n]*\})\n")
        line = orjson.loads(match.group(1))
        assert line["logger"] == "epd_trio.requests" and line["level"] == "INFO"
        assert line["request_id"] == "j1" and line["layout"] == "PD" and line["outcome"] == "ok"
        assert [(a["instance"], a["outcome"]) for a in line["attempts"]] == [(decode.url, "ok")]


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_shutdown_is_bounded_when_a_client_stops_reading(
    nursery: trio.Nursery, workers: str
) -> None:
    decode = FakeVLLM("prefill_decode")
    decode.behaviour.tokens = 10**6  # a stream far larger than the socket buffers
    await start_fakes(nursery, decode)
    graceful = 1.0
    async with serving("--decode", decode.url, "--workers", workers,
                       "--graceful-timeout", str(graceful)) as (process, url), await open_stuck_stream(url):
        # Never read: the stream is far larger than the socket buffers (~0.5 MB here).
        with trio.fail_after(30):
            await decode.wait_until(lambda: len(decode.requests()) == 1
                                    and len(decode.requests()[0].sent) > 200_000)
        started = trio.current_time()
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(graceful + 5):
            await process.wait()
        print(f"\nworkers={workers}: exited {trio.current_time() - started:.1f} s after "
              f"SIGTERM with a client that stopped reading (graceful {graceful:g} s)")


async def test_workers_share_the_encoder_cursor(nursery: trio.Nursery) -> None:
    encoders = [FakeVLLM("encode") for _ in range(3)]
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, *encoders, decode)
    async with serving("--encode", *[e.url for e in encoders], "--decode", decode.url,
                       "--workers", "2") as (process, url):
        statuses: list[int] = []

        async def one(n: int) -> None:
            # A fresh connection per request, so both workers accept some of them.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                r = await client.post(url + "/v1/chat/completions", json=chat_body(image(n)))
                statuses.append(r.status_code)

        async with trio.open_nursery() as requests:
            for n in range(30):
                requests.start_soon(one, n)
        assert statuses == [200] * 30
        # One shared counter: exactly round-robin, whichever worker accepted which request
        # (per-process counters are uneven for 20 of the 31 possible 2-worker splits).
        assert [len(e.requests()) for e in encoders] == [10, 10, 10]
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            await process.wait()


async def test_a_registration_reaches_every_worker(nursery: trio.Nursery) -> None:
    """A POST /instances reaches one worker; every worker routes over it, in one rotation."""
    encoders = [FakeVLLM("encode") for _ in range(3)]
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, *encoders, decode)
    admin = {"x-api-key": "admin-secret"}
    async with serving("--workers", "2", env={"EPD_ADMIN_KEY": "admin-secret"}) as (process, url):

        async def call(method: str, path: str, **kwargs: object) -> httpx.Response:
            # A fresh connection per call, so both workers accept some of them.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                return await client.request(method, url + path, **kwargs)  # type: ignore[arg-type]

        r = await call("POST", "/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance"
        for role, fake in [("prefill_decode", decode), *(("encode", e) for e in encoders)]:
            r = await call("POST", "/instances", headers=admin, json={"role": role, "url": fake.url})
            assert r.json() == {"registered": True}
        # Both worker processes list the whole roster (each answers with its pid): eight
        # versions, each registration and then what the instance said it serves.
        pids: set[int] = set()
        with trio.fail_after(60):
            while len(pids) < 2:
                listing = (await call("GET", "/instances", headers=admin)).json()
                assert listing["version"] == 8 and listing["layout"] == "E+PD"
                assert [e["url"] for e in listing["instances"]["encode"]] == [e.url for e in encoders]
                pids.add(listing["worker_pid"])
        assert pids == set(_workers_of(process.pid))

        async def burst(first: int, count: int) -> None:
            statuses: list[int] = []

            async def one(n: int) -> None:
                r = await call("POST", "/v1/chat/completions", json=chat_body(image(n)))
                statuses.append(r.status_code)

            async with trio.open_nursery() as requests:
                for n in range(first, first + count):
                    requests.start_soon(one, n)
            assert statuses == [200] * count

        await burst(0, 30)
        # One shared rotation over the registered encoders, whichever worker took what.
        assert [len(e.requests()) for e in encoders] == [10, 10, 10]
        r = await call("DELETE", "/instances", headers=admin, params={"url": encoders[1].url})
        assert r.json() == {"removed": True}
        await burst(30, 20)
        assert [len(e.requests()) for e in encoders] == [20, 10, 20]
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            await process.wait()


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes of ``pid`` (its children running spawn_main)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == pid and b"spawn_main" in cmdline:
                children.append(int(entry))
    return children


async def _wait_gone(pids: list[int]) -> None:
    """Wait (event-driven: a pidfd turns readable) until every process has exited."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)


async def test_a_dead_worker_stops_the_others(nursery: trio.Nursery) -> None:
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode)
    async with serving("--decode", decode.url, "--workers", "2",
                       "--graceful-timeout", "1") as (process, url):
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            assert (await client.get(url + "/health")).status_code == 200
        workers = _workers_of(process.pid)
        assert len(workers) == 2
        metrics_dir = _environ_of(workers[0])["PROMETHEUS_MULTIPROC_DIR"]
        os.kill(workers[0], signal.SIGKILL)
        with trio.fail_after(15):
            assert await process.wait() != 0  # a worker died: not a clean exit
            await _wait_gone(workers)
        # The parent removed the metrics directory all the same (docs/how-to/kubernetes.md).
        assert not await trio.Path(metrics_dir).exists()


async def test_workers_do_not_outlive_a_killed_parent(nursery: trio.Nursery) -> None:
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode)
    async with serving("--decode", decode.url, "--workers", "2") as (process, url):
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            assert (await client.get(url + "/health")).status_code == 200
        workers = _workers_of(process.pid)
        assert len(workers) == 2
        metrics_dir = _environ_of(workers[0])["PROMETHEUS_MULTIPROC_DIR"]
        process.kill()
        await process.wait()
        with trio.fail_after(20):  # their lifeline pipe reached end of file
            await _wait_gone(workers)
    # A SIGKILLed parent cannot remove its metrics directory: it is left behind (the known
    # limit docs/how-to/kubernetes.md names, with what to do). Removed here.
    assert await trio.Path(metrics_dir).is_dir()
    await trio.to_thread.run_sync(shutil.rmtree, metrics_dir)


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry]
    return {k.decode(): v.decode() for k, v in pairs}


async def test_metrics_add_up_across_workers(nursery: trio.Nursery) -> None:
    decode = FakeVLLM("prefill_decode", dp_size=2)
    await start_fakes(nursery, decode)
    per_round, rounds = 40, 5
    async with serving("--decode", f"{decode.url}#dp=2", "--workers", "2") as (process, url):
        statuses: list[int] = []

        async def one(k: int) -> None:
            # A fresh connection per request (and per scrape below), so both workers get some.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                r = await client.post(url + CHAT, json=chat_body(stream=k % 2 == 0))
                statuses.append(r.status_code)

        async def fresh_scrape() -> Samples:
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                return await scrape(client, url)

        def ok(m: Samples) -> float:
            return m.get("epd_trio_requests_total", endpoint=CHAT, outcome="ok", model="fake-model")

        n = 0

        async def a_round() -> None:
            nonlocal n
            async with trio.open_nursery() as requests:
                for k in range(per_round):
                    requests.start_soon(one, k)
            n += per_round
            assert statuses == [200] * n

            async def all_counted() -> bool:
                return ok(await fresh_scrape()) >= n

            # A request is counted just after its last byte went out: wait until all are.
            await poll_until(all_counted, 10)

        await a_round()
        workers = _workers_of(process.pid)
        assert len(workers) == 2
        metrics_dir = _environ_of(workers[0])["PROMETHEUS_MULTIPROC_DIR"]
        assert _environ_of(workers[1])["PROMETHEUS_MULTIPROC_DIR"] == metrics_dir
        assert await trio.Path(metrics_dir).is_dir()

        def both_served() -> bool:
            return len(counts := requests_per_worker(metrics_dir)) == 2 and all(counts.values())

        # The kernel picks the worker that accepts each connection, and under load it may give
        # one worker a whole round: another round, until both have served some.
        for _ in range(rounds - 1):
            if both_served():
                break
            await a_round()
        per_worker = requests_per_worker(metrics_dir)
        assert both_served(), f"one worker accepted all {n} connections: {per_worker}"
        assert sum(per_worker.values()) == n
        for _ in range(8):  # whichever worker answers, the totals are the same
            m = await fresh_scrape()
            assert ok(m) == n
            labels = {"role": "decode", "upstream": decode.url}
            assert m.get("epd_trio_upstream_requests_total", **labels) == n
            assert m.by("epd_trio_dp_rank_requests_total", "rank", **labels) == {
                "0": n / 2, "1": n / 2}  # the shared slot counter: exact alternation
            assert m.sum("epd_trio_time_to_first_byte_seconds_count") == n
            assert m.get("epd_trio_upstream_in_flight", **labels) == 0
            assert m.get("epd_trio_instance_healthy", **labels) == 1
        print(f"\nrequests served per worker: {sorted(per_worker.values())}")
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            assert await process.wait() == 0
        assert not await trio.Path(metrics_dir).exists()  # removed at exit


async def test_moriio_registrations_reach_every_worker(nursery: trio.Nursery) -> None:
    """With --workers 2, one worker binds the ZMQ socket; both route over what it hears."""
    port = free_port()  # for the registration socket, bound by a worker later
    prefill, decode = moriio_pair("WRITE", 6400, 62000, prefill_dp=2)
    await start_fakes(nursery, prefill, decode)
    admin = {"x-api-key": "k"}
    async with serving("--workers", "2", "--kv-connector", "moriio", "--moriio-registration",
                       f"127.0.0.1:{port}", env={"EPD_ADMIN_KEY": "k"}) as (process, url):
        for role, fake in (("P", prefill), ("D", decode)):
            assert fake.moriio is not None
            await nursery.start(MoriioStandIn(f"127.0.0.1:{port}", role,  # type: ignore[arg-type]
                                              fake.url.removeprefix("http://"),
                                              fake.moriio.zmq_address, dp_size=fake.dp_size,
                                              transfer_mode="WRITE").run)

        async def call(method: str, path: str, **kwargs: object) -> httpx.Response:
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:  # fresh: any worker
                return await client.request(method, url + path, **kwargs)  # type: ignore[arg-type]

        pids: set[int] = set()
        with trio.fail_after(60):
            while len(pids) < 2:
                listing = (await call("GET", "/instances", headers=admin)).json()
                # In, and said what they serve: until then a chat would get a 503.
                if listing["layout"] == "P+D" and all(
                        entry["models"] for role in ("prefill", "decode")
                        for entry in listing["instances"][role]):
                    pids.add(listing["worker_pid"])
        for n in range(8):
            r = await call("POST", "/v1/chat/completions", json=chat_body(image(n)))
            assert r.status_code == 200, r.text
        # One rotation across the workers: the prefill's two DP ranks alternate.
        assert [leg.rank for leg in prefill.requests()] == [0, 1] * 4
        assert len(decode.requests()) == 8
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            await process.wait()


async def run_cli(*args: str) -> tuple[int, str, str]:
    """``epd-trio ARGS`` to its end: the exit status, stdout and stderr."""
    with trio.fail_after(30):
        result = await trio.run_process([sys.executable, "-m", "epd_trio", *args],
                                        capture_stdout=True, capture_stderr=True, check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_taken_port_is_one_line_naming_the_address_and_exit_2(workers: str) -> None:
    """Issue 31: ``[Errno 98] Address already in use`` alone named no address."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, _, err = await run_cli("serve", "--port", str(port), "--workers", workers,
                                       "--decode", "http://127.0.0.1:9")
    assert status == 2
    (line,) = err.splitlines()  # one line, in the log format, no traceback
    assert line.endswith(" ERROR epd_trio.serve: cannot listen on 127.0.0.1:"
                         f"{port} (--host/--port): Address already in use"), line


async def test_workers_auto_says_how_many_and_why_before_anything_else() -> None:
    """``--workers auto`` follows this process's cgroup CPU limit (``_serve/process``; the
    container suite runs it under a real limit): the first line says the count and its source.
    A taken port makes the run end right after, with no server started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, _, err = await run_cli("serve", "--port", str(port), "--workers", "auto",
                                       "--decode", "http://127.0.0.1:9")
    assert status == 2
    first, second = err.splitlines()
    workers, note = auto_workers()  # the same cgroup as the child's
    assert first.endswith(f" INFO epd_trio.serve: {note}"), first
    assert note.startswith(f"--workers auto: {workers} (")
    assert "cannot listen" in second


def test_a_metrics_directory_that_cannot_be_made_says_where_tempfile_looked() -> None:
    """``--workers N`` without a writable temporary directory (the image's suite sees the real
    line, on a read-only root): tempfile falls back from an unwritable TMPDIR on its own, so the
    line names the places it tries when it found none, and the one it chose otherwise."""
    none = cannot_make_metrics_dir(FileNotFoundError(2, "No usable temporary directory"), None)
    assert "found none writable" in none and "TMPDIR, TEMP and TMP when set, then /tmp" in none
    assert "under TMPDIR" not in none
    full = cannot_make_metrics_dir(OSError(28, "No space left on device"), "/var/tmp")
    assert "under the temporary directory (/var/tmp) and cannot make one there: No space " in full
    for line in (none, full):
        assert line.endswith("mount a writable volume at /tmp or at TMPDIR "
                             "(docs/how-to/kubernetes.md), or run with --no-metrics")
        assert "\n" not in line


@pytest.mark.parametrize("command", ["serve", "demo"])
async def test_a_port_out_of_range_is_one_line_and_exit_2(command: str) -> None:
    """Issue 31: ``--port 70000`` was an ``OverflowError`` traceback."""
    settings = ["--decode", "http://127.0.0.1:9"] if command == "serve" else []
    status, _, err = await run_cli(command, "--port", "70000", *settings)
    assert status == 2
    assert err == ("epd-trio: --port 70000: not a TCP port (0 to 65535; 0 = any free port)\n")


def json_lines(text: bytes) -> list[dict[str, object]]:
    """The JSON log lines in ``text`` (``--log-format json``), in order."""
    return [orjson.loads(line) for line in text.splitlines() if line.startswith(b"{")]


async def read_to_end(stream: trio.abc.ReceiveStream) -> bytes:
    seen = b""
    with trio.fail_after(30):
        while chunk := await stream.receive_some():
            seen += chunk
    return seen


async def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests(
    nursery: trio.Nursery,
) -> None:
    """Issue 31: within the shutdown grace a stream in flight ends normally; from the signal
    on, a new request gets 503 ``shutting_down`` with ``Connection: close``, and ``/ready``
    503."""
    release = trio.Event()
    decode = FakeVLLM("prefill_decode")
    decode.behaviour.chunk_gate = release.wait  # the stream runs until the test says
    await start_fakes(nursery, decode)
    async with serving("--decode", decode.url, "--request-log", "--log-format", "json",
                       "--shutdown-grace", "30") as (process, url):
        assert process.stderr is not None
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client, client.stream(
                "POST", url + CHAT, json=chat_body(stream=True),
                headers={"x-request-id": "long"}) as r:
            chunks = r.aiter_bytes()
            first = await anext(chunks)
            process.send_signal(signal.SIGTERM)
            _, seen = await read_until(process.stderr, rb"1 request\(s\) in flight")
            ready = await client.get(url + "/ready")
            assert ready.status_code == 503, ready.text
            assert ready.json()["reason"] == "the proxy is shutting down"
            late = await client.post(url + CHAT, json=chat_body(),
                                     headers={"x-request-id": "late"})
            assert late.status_code == 503 and late.headers["connection"] == "close"
            assert late.json()["error"]["code"] == "shutting_down"
            release.set()
            rest = b"".join([chunk async for chunk in chunks])
        assert (first + rest).endswith(b"data: [DONE]\n\n") and b"error" not in rest
        with trio.fail_after(10):
            assert await process.wait() == 0
        lines = json_lines(seen + await read_to_end(process.stderr))
    outcomes = {line["request_id"]: (line["outcome"], line["status"])
                for line in lines if line.get("logger") == "epd_trio.requests"}
    assert outcomes == {"late": ("shutdown", 503), "long": ("ok", 200)}


async def test_a_stream_still_running_when_the_grace_ends_gets_a_shutdown_event(
    nursery: trio.Nursery,
) -> None:
    """Issue 31: it used to end with a truncated chunked body and no event, logged as
    ``cancelled 499`` like a client that left."""
    decode = FakeVLLM("prefill_decode")
    held = trio.Event()
    decode.behaviour.chunk_gate = held.wait  # never set: the stream outlives the grace
    await start_fakes(nursery, decode)
    async with serving("--decode", decode.url, "--request-log", "--log-format", "json",
                       "--shutdown-grace", "0.2") as (process, url):
        assert process.stderr is not None
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client, client.stream(
                "POST", url + CHAT, json=chat_body(stream=True),
                headers={"x-request-id": "cut"}) as r:
            chunks = r.aiter_bytes()
            first = await anext(chunks)
            process.send_signal(signal.SIGTERM)
            rest = b"".join([chunk async for chunk in chunks])  # ends: no truncation
        events = (first + rest).decode().strip().split("\n\n")
        assert events[-1].startswith("data: {") and "[DONE]" not in rest.decode()
        error = orjson.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and "shut down" in error["message"]
        assert error["type"] == "service_unavailable"
        with trio.fail_after(10):
            assert await process.wait() == 0
        lines = json_lines(await read_to_end(process.stderr))
    (request,) = [line for line in lines if line.get("logger") == "epd_trio.requests"]
    assert (request["request_id"], request["outcome"]) == ("cut", "shutdown")
    assert any("shutdown grace of 0.2 s over: ending 1 request(s)" in str(line.get("message"))
               for line in lines)


async def test_registering_an_encoder_keeps_every_worker_ready(nursery: trio.Nursery) -> None:
    """Issue 31: with ``--workers 2`` and a registered ``prefill_decode``, registering an
    encoder turned ``/ready`` 503 (in each worker, until its own probe of the newcomer
    succeeded), though the encoder served requests. Here the newcomer's probes fail (below
    the threshold): both workers stay ready."""
    decode, encoder = FakeVLLM("prefill_decode"), FakeVLLM("encode")
    encoder.behaviour.healthy = False
    await start_fakes(nursery, decode, encoder)
    admin = {"x-api-key": "admin-secret"}
    # Probes often (each worker's first probe of the decode comes soon), failing never enough
    # to evict the encoder.
    async with serving("--workers", "2", "--health-interval", "0.1", "--health-threshold",
                       "100000", env={"EPD_ADMIN_KEY": "admin-secret"}) as (_, url):

        async def ready_by_worker() -> tuple[int, httpx.Response]:
            # A fresh connection per call (either worker may accept it); the same one for
            # /instances, which names the worker.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                pid = (await client.get(url + "/instances", headers=admin)).json()["worker_pid"]
                return pid, await client.get(url + "/ready")

        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            r = await client.post(url + "/instances", headers=admin,
                                  json={"role": "prefill_decode", "url": decode.url})
            assert r.json() == {"registered": True}
        seen: set[int] = set()
        with trio.fail_after(60):  # each worker probes the decode at once, then is ready
            while len(seen) < 2:
                pid, ready = await ready_by_worker()
                if ready.status_code == 200:
                    seen.add(pid)
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            r = await client.post(url + "/instances", headers=admin,
                                  json={"role": "encode", "url": encoder.url})
            assert r.json() == {"registered": True}
        answered: dict[int, list[int]] = {}
        with trio.fail_after(60):
            while len(answered) < 2:
                pid, ready = await ready_by_worker()
                answered.setdefault(pid, []).append(ready.status_code)
                assert set(ready.json()["roles"]) == {"encode", "prefill_decode"}, ready.text
        assert all(statuses == [200] * len(statuses) for statuses in answered.values()), answered
