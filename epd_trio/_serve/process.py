"""Process-wide setup of a serving process: logging, the garbage collector, the fd limit; and
the CPU limit ``--workers auto`` follows.

Only the entry points that own their process call ``setup_serving_process`` (``epd_trio.app``
for ``hypercorn epd_trio.app:app``, and each ``epd-trio serve`` worker); ``create_app`` does not,
so a service embedding the app keeps its own logging and collector settings.
"""

from __future__ import annotations

import gc
import os
import resource

from .._core.config import Settings
from .cpu_quota import CpuLimit, cpu_limit, quota_dirs, workers_for
from .logs import configure_logging


def tune_gc(threshold: int) -> None:
    """Collect the young generation every ``threshold`` allocations (0: leave Python's default).

    Why: each proxied request allocates a few thousand short-lived objects (trio tasks and
    cancel scopes, h11 events, dicts); at Python's default of 700 the collector ran several
    times per request and took about 10 % of the proxy's CPU. ``gc.freeze()`` moves what exists
    at start-up (modules, classes, the app) out of the collector's way for good.
    """
    if threshold <= 0:
        return
    _, gen1, gen2 = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, gen1, gen2)


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit now in force.

    Why: every client connection is a file descriptor, idle and slow ones included (each is held
    up to ``--keep-alive`` seconds), and so is every upstream connection. Many distributions
    start services with a soft limit of 1024 (kept low for programs that use ``select``; trio
    uses epoll): 1000 slow-header connections then take every fd, new clients wait in the
    listen backlog and upstream connects fail (``bench.slow_headers --proxy-nofile 1024``). The
    hard limit stays the operator's bound. If the raise is refused, the limit is left as it is.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft  # unlimited (macOS): no finite number to raise to; leave it
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


def setup_serving_process(settings: Settings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    tune_gc(settings.gc_threshold)
    raise_fd_limit()


def read_cpu_limit(root: str = "/") -> CpuLimit | None:
    """This process's CPU limit from its cgroup files (``_serve/cpu_quota``); None without one.

    ``root`` stands for ``/`` (tests point it at a directory laid out like one). A file that
    cannot be read counts as setting no limit: a system without cgroups has none to follow."""

    def read(path: str) -> str | None:
        try:
            with open(os.path.join(root, path.lstrip("/"))) as file:
                return file.read()
        except OSError:
            return None

    dirs = quota_dirs(read("/proc/self/cgroup") or "", read("/proc/self/mountinfo") or "")
    return cpu_limit((directory, [read(path) for path in directory.files]) for directory in dirs)


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity (a cpuset), where the system has one."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # macOS: no affinity, and no cgroup to read either


def auto_workers(root: str = "/") -> tuple[int, str]:
    """``--workers auto``: how many workers, and the line that says why (said at start)."""
    limit = read_cpu_limit(root)
    cpus = available_cpus()
    workers = workers_for(limit, cpus)
    if limit is None:
        return workers, f"--workers auto: {workers} (no CPU limit found in this process's cgroup)"
    return workers, (f"--workers auto: {workers} (CPU limit {limit.cpus:g} in {limit.source}, "
                     f"{cpus} CPU{'s' if cpus != 1 else ''} to run on)")
