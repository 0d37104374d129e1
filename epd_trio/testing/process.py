"""Helpers for driving servers started as subprocesses (tests and the bench)."""

from __future__ import annotations

import re

import trio


async def read_url(stream: trio.abc.ReceiveStream, pattern: bytes, *, limit: float = 30.0) -> str:
    """Read a server's output until ``pattern`` (one group: the URL) matches; return the URL.

    Raises ``RuntimeError`` with the output so far if the stream ends first (the process died),
    and ``trio.TooSlowError`` after ``limit`` seconds.
    """
    seen = b""
    with trio.fail_after(limit):
        while not (match := re.search(pattern, seen)):
            chunk = await stream.receive_some()
            if not chunk:
                raise RuntimeError(f"process exited before printing its URL:\n{seen.decode()}")
            seen += chunk
    return match.group(1).decode()
