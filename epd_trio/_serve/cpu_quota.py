"""How many CPUs a process may use by its cgroup's CPU quota: what ``--workers auto`` starts.

Why a quota, not ``os.cpu_count()``: in a container the kernel reports the node's cores (16 on
a 16-core node) whatever the container's limit. A limit of 2 CPUs is a CFS quota (cgroup v2:
``cpu.max`` holds ``200000 100000``; v1: ``cpu.cfs_quota_us`` 200000 over
``cpu.cfs_period_us`` 100000): once the cgroup's processes together have run 2 CPU-periods in a
period, all of them wait for the next one. Sixteen busy workers under that quota are throttled
every period, and a request that lands on a throttled worker waits for the rest of it.

Why rounded down: a worker the quota cannot run for a whole period is throttled in every busy
period; Uber's automaxprocs (Go's GOMAXPROCS from the same quota) rounds down for that reason.
At least 1, and never more than the CPUs the process may run on (``sched_getaffinity``, a
cpuset). No quota (``max``, ``-1``, or no cgroup file): 1, the host default; a CPU *request*
(``cpu.weight``, ``cpu.shares``) is a share under contention, not a limit, and is not read
(the JDK read shares for years and gave it up, JDK-8281181).

Where the files are: ``/proc/self/cgroup`` names the process's cgroup in each hierarchy, and
``/proc/self/mountinfo`` says where each hierarchy is mounted and which of its cgroups is the
mount's root: in a container its own cgroup is the root of ``/sys/fs/cgroup`` (a private
cgroup namespace, or a bind mount of that cgroup). Every cgroup from the process's own up to
the mount's root bounds it, so the smallest quota among them is the limit.

Pure: the caller reads the files (``epd_trio._serve.process.read_cpu_limit``) and passes their
text in; a file that could not be read is None. Why here and not in ``_core``: its one user is
``process``, process plumbing, and ``_core`` holds what the request path shares. It keeps the
core's rule all the same (the standard library only: ``tests/test_layout.py``,
``PURE_OUTSIDE_CORE``), so it is tested with plain asserts on the files' text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["CpuLimit", "QuotaDir", "cpu_limit", "quota_dirs", "workers_for"]

#: The cgroup v2 file of a CPU quota, and the v1 pair.
CPU_MAX = "cpu.max"
CFS_QUOTA = "cpu.cfs_quota_us"
CFS_PERIOD = "cpu.cfs_period_us"


@dataclass(frozen=True, slots=True)
class QuotaDir:
    """A cgroup directory whose CPU quota bounds the process, and which files hold it."""

    path: str
    #: 2: ``cpu.max``; 1: ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``.
    version: int

    @property
    def files(self) -> tuple[str, ...]:
        names = (CPU_MAX,) if self.version == 2 else (CFS_QUOTA, CFS_PERIOD)
        return tuple(f"{self.path.rstrip('/')}/{name}" for name in names)


@dataclass(frozen=True, slots=True)
class CpuLimit:
    """A quota in CPUs (1.5: one and a half CPUs' time per period), and the file it came from."""

    cpus: float
    source: str


def _unescape(field: str) -> str:
    """A mountinfo path field: the kernel writes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's cgroup in the v2 hierarchy and in the v1 hierarchy holding ``cpu``."""
    v2 = v1 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """Each cgroup mount: (its root cgroup, where it is mounted, type, super options)."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        fs_type = fields[dash + 1]
        if fs_type not in ("cgroup", "cgroup2"):
            continue
        options = set(fields[dash + 3].split(","))
        found.append((_unescape(fields[3]), _unescape(fields[4]), fs_type, options))
    return found


def _below(mount_point: str, mount_root: str, cgroup: str) -> list[str]:
    """The directories from ``cgroup`` up to the mount's root, as paths under the mount point.

    A cgroup outside the mount's root (``/..`` from a cgroup namespace) is seen only as the
    mount point itself."""
    root = mount_root.rstrip("/")
    inside = (cgroup == root or cgroup.startswith(root + "/")) and ".." not in cgroup.split("/")
    relative = cgroup[len(root):].strip("/") if inside else ""
    parts = relative.split("/") if relative else []
    point = mount_point.rstrip("/")
    return [f"{point}/{'/'.join(parts[:n])}".rstrip("/") or "/"
            for n in range(len(parts), -1, -1)]


def quota_dirs(proc_cgroup: str, mountinfo: str) -> list[QuotaDir]:
    """Every cgroup directory whose CPU quota bounds this process, innermost first, from the
    text of ``/proc/self/cgroup`` and ``/proc/self/mountinfo``. On a hybrid system both the v2
    and the v1 ``cpu`` hierarchies are listed: only one of them has the quota files."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    dirs: list[QuotaDir] = []
    for root, point, fs_type, options in _mounts(mountinfo):
        if fs_type == "cgroup2" and v2 is not None:
            dirs += [QuotaDir(path, 2) for path in _below(point, root, v2)]
        elif fs_type == "cgroup" and v1 is not None and "cpu" in options:
            dirs += [QuotaDir(path, 1) for path in _below(point, root, v1)]
    return dirs


def _number(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def quota_of(directory: QuotaDir, contents: Sequence[str | None]) -> float | None:
    """The quota in CPUs that ``directory``'s files say (``contents`` in ``files`` order),
    None when they set none (``max``, ``-1``) or could not be read or parsed."""
    if directory.version == 2:
        fields = (contents[0] or "").split()
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota, period = _number(fields[0]), _number(fields[1])
    else:
        quota, period = _number(contents[0]), _number(contents[1])
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return quota / period


def cpu_limit(readings: Iterable[tuple[QuotaDir, Sequence[str | None]]]) -> CpuLimit | None:
    """The smallest quota among the directories' (None: none sets one)."""
    found = [CpuLimit(cpus, directory.files[0]) for directory, contents in readings
             if (cpus := quota_of(directory, contents)) is not None]
    return min(found, key=lambda limit: limit.cpus, default=None)


def workers_for(limit: CpuLimit | None, cpus: int) -> int:
    """``--workers auto``: the quota rounded down, at least 1 and at most ``cpus`` (the CPUs
    the process may run on); 1 without a quota."""
    if limit is None:
        return 1
    return max(1, min(math.floor(limit.cpus), cpus))
