"""Processes by PID: liveness, process trees, stopping a tree, log tails.

Why by PID and never by name: other vLLM servers may run on the same machine (another checkout's
cluster, a colleague's benchmark); only the processes this harness started, identified by PID
and start time, are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

#: Seconds between two looks at a process that is expected to exit.
POLL_INTERVAL = 0.2


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1], pgid [2])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the PID, a process's identity."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, ticks: int | None = None) -> bool:
    """``pid`` runs (a zombie does not count); with ``ticks``, and is still the same process."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def tree(pid: int) -> set[int]:
    """``pid``, its descendants and its process group's members (a vLLM server is a group leader)."""
    parents: dict[int, int] = {}
    groups: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parents[int(entry)] = int(fields[1])
            groups[int(entry)] = int(fields[2])
    found = {pid} | {p for p, g in groups.items() if g == pid}
    grew = True
    while grew:
        children = {p for p, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return found


def stop_tree(pid: int, ticks: int | None = None, *, timeout: float = 30.0) -> list[int]:
    """Stop ``pid`` and everything it started: SIGTERM, then SIGKILL what is left after ``timeout``.

    Only the root gets SIGTERM (vLLM stops its own children); the tree is recorded first so that
    children re-parented to init are still found. Returns the PIDs that had to be SIGKILLed. A
    ``pid`` that is gone, or (with ``ticks``) is now another process, is left alone.
    """
    if not alive(pid, ticks):
        return []
    members = tree(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (left := [p for p in members if alive(p)]) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL)
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL)
    return left


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
