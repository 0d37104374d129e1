"""The README's first command: the demo on the embedded fake cluster, as a user runs it."""

import errno
import re
import socket
import sys

import trio

from epd_trio.__main__ import _bind_error


async def test_demo_check_routes_every_request() -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "epd_trio", "demo", "--check", "4", "--port", "0"],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "layout E+P+D" in out and "demo check: all requests succeeded" in out
    assert "request 0 (json): HTTP 200 via E0 -> P0 rank 0 -> D0 rank 0" in out
    assert "request 3 (stream): HTTP 200 via E0 -> P1 rank 1 -> D1 rank 1" in out
    # Two models, each a pool of its own instances, and an alias over both (3 to 1).
    assert "  model fake-model (E+P+D)\n" in out and "  model fake-text (P+D)\n" in out
    assert "  alias chat: fake-model 3, fake-text 1\n" in out
    assert "request 4 (json, fake-text): HTTP 200 via fake-text P0 -> fake-text D0 rank 0" in out
    alias = re.findall(r"request \d+ \(\w+, chat -> ([\w-]+)\): HTTP 200", out)
    assert sorted(alias) == ["fake-model"] * 3 + ["fake-text"], out


async def test_demo_with_moriio_registers_over_zmq_and_routes_every_request() -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "epd_trio", "demo", "--check", "4", "--port", "0",
             "--kv-connector", "moriio", "--moriio-mode", "WRITE"],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "layout E+P+D, MoRIIO WRITE mode, registered over ZMQ on 127.0.0.1:" in out
    assert "demo check: all requests succeeded" in out
    assert "request 0 (json): HTTP 200 via E0 -> P0 rank 0 -> D0 rank 0" in out


async def test_demo_on_a_taken_port_says_so_and_takes_the_next_free_one() -> None:
    """Issue 31: with its port taken (8000 is vLLM's own) the demo printed a 60-line
    ExceptionGroup; now it says so in one line and serves on the next free port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(60):
            result = await trio.run_process(
                [sys.executable, "-m", "epd_trio", "demo", "--check", "1", "--port", str(port)],
                capture_stdout=True, capture_stderr=True, check=False,
            )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    said, *_ = out.splitlines()
    match = re.fullmatch(rf"epd_trio demo: 127\.0\.0\.1:{port} is taken; using port (\d+) "
                         r"instead \(--port chooses\)", said)
    assert match is not None, out
    assert f"proxy on http://127.0.0.1:{match.group(1)} " in out
    assert "demo check: all requests succeeded" in out


def test_a_port_taken_after_the_check_is_one_line_too() -> None:
    """The demo's servers start in nurseries, so a port another process took between the
    check and the bind arrives as an exception group: ``main`` finds its ``OSError``."""
    error = OSError(errno.EADDRINUSE, "Address already in use")
    assert _bind_error(BaseExceptionGroup("start", [ExceptionGroup("serve", [error])])) is error
    assert _bind_error(BaseExceptionGroup("start", [error, ValueError("x")])) is None
