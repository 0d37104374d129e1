"""Helpers for driving servers started as subprocesses (tests and the bench)."""

from __future__ import annotations

import re

import trio


async def read_until(
    stream: trio.abc.ReceiveStream, pattern: bytes, *, limit: float = 30.0
) -> tuple[re.Match[bytes], bytes]:
    """Read a process's output until ``pattern`` matches; the match and everything read.

    Raises ``RuntimeError`` with the output so far if the stream ends first (the process died),
    and ``trio.TooSlowError`` after ``limit`` seconds.
    """
    seen = b""
    with trio.fail_after(limit):
        while not (match := re.search(pattern, seen)):
            chunk = await stream.receive_some()
            if not chunk:
                raise RuntimeError(f"process exited before printing {pattern!r}:\n"
                                   f"{seen.decode()}")
            seen += chunk
    return match, seen


async def read_url(stream: trio.abc.ReceiveStream, pattern: bytes, *, limit: float = 30.0) -> str:
    """Read a server's output until ``pattern`` (one group: the URL) matches; return the URL."""
    match, _ = await read_until(stream, pattern, limit=limit)
    return match.group(1).decode()


async def stop_process(process: trio.Process, grace: float = 15.0) -> None:
    """SIGTERM, ``grace`` seconds to exit, then SIGKILL; returns once the process is reaped.
    Shielded: a test's or a bench's teardown must not leave a server running because the
    caller was being cancelled."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.terminate()
            with trio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
