"""The README's first command: the demo on the embedded fake cluster, as a user runs it."""

import sys

import trio


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
