"""A client that sends its request head too slowly is disconnected; others are served meanwhile.

What bounds it is Hypercorn's idle timer (``keep_alive_timeout``, the proxy's ``--keep-alive``):
armed when the connection opens and stopped only once a whole request head has been parsed, so
it is a deadline for the head, not a per-read timeout that each trickled byte would reset. The
attackers here send a byte far more often than the deadline: a per-read timer would never fire,
and with the deadline removed (or made per-read) these tests fail at their ``fail_after``.

The trickle's ``trio.sleep`` is the attack's own pacing (the gaps between bytes are what is under
test), not synchronisation: the tests wait on sockets (the proxy's end of file) and on events.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from epd_trio.testing import FakeVLLM, run_cluster
from epd_trio.testing.process import read_url

from helpers import CHAT, chat_body, start_fakes

HYPERCORN = [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--bind", "127.0.0.1:0"]

#: The proxy's keep-alive, hence its deadline for a request head (seconds).
HEAD_DEADLINE = 1.5
#: Seconds between two bytes of an attacker's head: well inside the deadline.
TRICKLE_GAP = HEAD_DEADLINE / 6
#: Longest any test waits for the proxy to act: past it the head was not bounded.
GUARD = HEAD_DEADLINE + 15


@dataclass
class SlowHead:
    """What one slow-header connection saw."""

    connected: float = 0.0
    closed: float | None = None
    trickled: int = 0  # header bytes sent after the request line
    longest_gap: float = 0.0  # between two of our sends
    received: bytes = b""


async def trickle_head(url: str, seen: SlowHead, started: trio.Event) -> None:
    """Send a request line, then one header byte every ``TRICKLE_GAP`` until the proxy closes."""
    parts = urlsplit(url)
    async with await trio.open_tcp_stream(parts.hostname, parts.port) as stream:
        seen.connected = last_send = trio.current_time()
        await stream.send_all(f"POST {CHAT} HTTP/1.1\r\n".encode())
        started.set()
        pattern = b"x-slow: a\r\n"
        while True:
            with trio.move_on_after(TRICKLE_GAP):
                try:
                    data = await stream.receive_some()
                except trio.BrokenResourceError:
                    # The proxy closed with our last byte unread in its buffer: the kernel
                    # then resets the connection instead of ending it, and that is its close.
                    data = b""
                seen.received += data
                if not data:  # the proxy closed the connection
                    seen.closed = trio.current_time()
                    return
                continue
            try:
                await stream.send_all(pattern[seen.trickled % len(pattern):][:1])
            except trio.BrokenResourceError:  # closed between our receive and this send
                seen.closed = trio.current_time()
                return
            now = trio.current_time()
            seen.longest_gap = max(seen.longest_gap, now - last_send)
            seen.trickled, last_send = seen.trickled + 1, now


def assert_cut_by_the_head_deadline(seen: SlowHead) -> None:
    assert seen.closed is not None
    assert seen.closed - seen.connected >= HEAD_DEADLINE * 0.9  # the deadline, not an error
    assert seen.trickled >= 3 and seen.longest_gap < HEAD_DEADLINE  # a per-read timer: never
    assert seen.received == b""  # Hypercorn closes without an answer (no 408)


async def test_slow_header_connections_are_closed_while_a_normal_request_succeeds(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(prefills=1, decodes=1, keep_alive=HEAD_DEADLINE) as c:
        attackers = [SlowHead() for _ in range(3)]
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                for seen in attackers:
                    started = trio.Event()
                    nursery.start_soon(trickle_head, c.proxy_url, seen, started)
                    await started.wait()
                # Every attacker holds a connection with half a head: a normal client gets in.
                r = await client.post(c.proxy_url + CHAT, json=chat_body())
                answered = trio.current_time()
                assert r.status_code == 200, r.text
                assert all(seen.closed is None for seen in attackers)  # really meanwhile
        for seen in attackers:
            assert_cut_by_the_head_deadline(seen)
        assert answered < min(seen.closed for seen in attackers)  # type: ignore[type-var]
        assert len(c.decodes[0].requests()) == 1  # only the normal request reached vLLM


async def test_epd_trio_serve_keep_alive_flag_bounds_the_head(nursery: trio.Nursery) -> None:
    """The production entry: ``--keep-alive`` reaches Hypercorn and bounds a trickled head."""
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode)
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--decode", decode.url,
         "--keep-alive", str(HEAD_DEADLINE)], stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        url = await read_url(process.stderr, rb"listening on (http://\S+)")
        seen = SlowHead()
        with trio.fail_after(GUARD):
            await trickle_head(url, seen, trio.Event())
        assert_cut_by_the_head_deadline(seen)
    finally:
        process.kill()
        await process.wait()


def _soft_fd_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


# Plain Hypercorn with ``--workers 0`` serves in the process it starts (no worker child to find).
@pytest.mark.parametrize("entry, pattern", [
    (["-m", "epd_trio", "serve", "--port", "0"], rb"listening on (http://\S+)"),
    ([*HYPERCORN[1:], "--workers", "0", "epd_trio.app:app"], rb"Running on (http://\S+)"),
], ids=["epd-trio serve", "hypercorn"])
async def test_serving_process_raises_its_fd_limit_to_the_hard_limit(
    nursery: trio.Nursery, entry: list[str], pattern: bytes
) -> None:
    """Held slow connections cost an fd each: a distribution's soft 1024 must not cap them."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"needs a finite hard fd limit above 256 (it is {hard})")
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode)
    process = await trio.lowlevel.open_process(
        [sys.executable, *entry], stderr=subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("EPD_")},
             "EPD_DECODE_URLS": decode.url},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        assert process.stderr is not None
        url = await read_url(process.stderr, pattern)
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            assert (await client.get(url + "/health")).status_code == 200  # set up and serving
        assert _soft_fd_limit(process.pid) == hard
    finally:
        process.kill()
        await process.wait()


async def test_a_slow_body_gets_a_408_and_frees_its_admission_place() -> None:
    """A complete head, then a body that never ends: the body deadline answers it, and the one
    admission place it held serves the next client."""
    async with run_cluster(decodes=1, max_inflight=1, admission_timeout=5,
                           body_timeout=0.5) as c:
        parts = urlsplit(c.proxy_url)
        async with await trio.open_tcp_stream(parts.hostname, parts.port) as stream:
            await stream.send_all(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\n"
                                  "content-type: application/json\r\n"
                                  "content-length: 100\r\n\r\n{".encode())
            answer = b""
            with trio.fail_after(GUARD):
                while chunk := await stream.receive_some(65536):
                    answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 408") and b"connection: close" in head
        assert b"invalid_request_error" in answer and b"not received within 0.5 s" in answer
        async with httpx.AsyncClient() as client:
            r = await client.post(c.proxy_url + CHAT, json=chat_body(), timeout=GUARD)
        assert r.status_code == 200
