"""``--workers auto``: the cgroup files that bound a process, their quota, the worker count
(``_serve/cpu_quota``, pure), and the reading shell (``_serve/process``) on a fake root."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_trio._serve.cpu_quota import CpuLimit, QuotaDir, cpu_limit, quota_dirs, quota_of, workers_for
from epd_trio._serve.process import auto_workers, available_cpus, read_cpu_limit

#: /proc/self/mountinfo lines, as the kernel writes them.
V2_ROOT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw"
V2_HYBRID = "40 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
V1_CPU = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu"
V1_CPUACCT = "33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct"
V1_MEMORY = "34 31 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
#: podman on cgroup v1 (measured here): the container's cgroup bind-mounted as the root.
PODMAN = "/libpod_parent/libpod-338b"
V1_PODMAN = (f"92 91 0:29 {PODMAN} /sys/fs/cgroup/cpu ro,nosuid,nodev,noexec,relatime - "
             "cgroup cgroup rw,cpu")
V1_JOINED = ("35 31 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:9 - "
             "cgroup cgroup rw,cpu,cpuacct")
ESCAPED = r"36 23 0:33 / /mnt/my\040cgroups rw - cgroup2 cgroup2 rw"


@pytest.mark.parametrize(("proc_cgroup", "mountinfo", "expected"), [
    pytest.param("0::/\n", V2_ROOT, [QuotaDir("/sys/fs/cgroup", 2)],
                 id="v2 container (private cgroup namespace): its own cgroup is the root"),
    pytest.param("0::/system.slice/epd.service\n", V2_ROOT,
                 [QuotaDir("/sys/fs/cgroup/system.slice/epd.service", 2),
                  QuotaDir("/sys/fs/cgroup/system.slice", 2), QuotaDir("/sys/fs/cgroup", 2)],
                 id="v2 host service: its cgroup and every ancestor"),
    pytest.param("0::/../../kubepods/pod1\n", V2_ROOT, [QuotaDir("/sys/fs/cgroup", 2)],
                 id="v2 cgroup outside the namespace's root: the mount point only"),
    pytest.param(f"4:memory:{PODMAN}\n1:cpu:{PODMAN}\n0::{PODMAN}\n", V1_PODMAN,
                 [QuotaDir("/sys/fs/cgroup/cpu", 1)],
                 id="v1 podman: the mount's root is the container's cgroup"),
    pytest.param("2:cpuacct:/\n1:cpu:/\n0::/\n",
                 "\n".join([V1_CPU, V1_CPUACCT, V1_MEMORY, V2_HYBRID]),
                 [QuotaDir("/sys/fs/cgroup/cpu", 1), QuotaDir("/sys/fs/cgroup/unified", 2)],
                 id="hybrid host (this machine): v1 cpu, and a v2 tree without the controller"),
    pytest.param("3:cpu,cpuacct:/docker/abc\n", V1_JOINED,
                 [QuotaDir("/sys/fs/cgroup/cpu,cpuacct/docker/abc", 1),
                  QuotaDir("/sys/fs/cgroup/cpu,cpuacct/docker", 1),
                  QuotaDir("/sys/fs/cgroup/cpu,cpuacct", 1)],
                 id="v1 joined cpu,cpuacct controllers"),
    pytest.param("0::/\n", ESCAPED, [QuotaDir("/mnt/my cgroups", 2)],
                 id="a mount point with an escaped space"),
    pytest.param("1:cpu:/\n", V1_MEMORY, [], id="no cpu hierarchy mounted"),
    pytest.param("", "", [], id="no cgroups at all (not Linux, or /proc unreadable)"),
    pytest.param("garbage\n0::/\n", "not a mount line\n" + V2_ROOT,
                 [QuotaDir("/sys/fs/cgroup", 2)], id="lines that are not ours are skipped"),
])
def test_the_cgroup_directories_that_bound_the_process(
    proc_cgroup: str, mountinfo: str, expected: list[QuotaDir]
) -> None:
    assert quota_dirs(proc_cgroup, mountinfo) == expected


def test_each_version_names_its_own_files() -> None:
    assert QuotaDir("/sys/fs/cgroup", 2).files == ("/sys/fs/cgroup/cpu.max",)
    assert QuotaDir("/sys/fs/cgroup/cpu/", 1).files == ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                                                        "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


V2, V1 = QuotaDir("/c", 2), QuotaDir("/c", 1)


@pytest.mark.parametrize(("directory", "contents", "cpus"), [
    (V2, ["200000 100000\n"], 2.0),
    (V2, ["150000 100000\n"], 1.5),
    (V2, ["50000 100000"], 0.5),
    (V2, ["max 100000\n"], None),  # no limit
    (V2, [None], None),  # no such file (the controller is not enabled here)
    (V2, ["200000\n"], None),  # not what the kernel writes: not a limit we can trust
    (V2, ["lots 100000"], None),
    (V2, ["0 100000"], None),
    (V1, ["200000\n", "100000\n"], 2.0),
    (V1, ["-1\n", "100000\n"], None),  # no limit
    (V1, ["50000", "100000"], 0.5),
    (V1, ["200000", None], None),
    (V1, [None, None], None),
    (V1, ["200000", "0"], None),
])
def test_the_quota_of_one_directory(directory: QuotaDir, contents: list[str | None],
                                    cpus: float | None) -> None:
    assert quota_of(directory, contents) == cpus


def test_the_smallest_quota_bounds_the_process() -> None:
    inner, outer = QuotaDir("/c/a", 2), QuotaDir("/c", 2)
    assert cpu_limit([(inner, ["400000 100000"]), (outer, ["150000 100000"])]) == CpuLimit(
        1.5, "/c/cpu.max")
    assert cpu_limit([(inner, ["max 100000"]), (outer, ["300000 100000"])]) == CpuLimit(
        3.0, "/c/cpu.max")
    assert cpu_limit([(inner, ["max 100000"]), (outer, [None])]) is None
    assert cpu_limit([]) is None


@pytest.mark.parametrize(("cpus", "available", "workers"), [
    (None, 16, 1),  # no limit: the host default, not the node's 16 cores
    (2.0, 16, 2),
    (2.9, 16, 2),  # rounded down: a third worker would be throttled every busy period
    (0.5, 16, 1),  # at least one
    (1.0, 16, 1),
    (8.0, 2, 2),  # never more than the CPUs the process may run on (a cpuset)
    (64.0, 64, 64),
])
def test_workers_follow_the_limit(cpus: float | None, available: int, workers: int) -> None:
    limit = None if cpus is None else CpuLimit(cpus, "/c/cpu.max")
    assert workers_for(limit, available) == workers


def fake_root(tmp_path: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_the_shell_reads_the_files_the_core_names(tmp_path: Path) -> None:
    """A v2 service in a slice with a quota of 3, inside a slice with a quota of 2."""
    root = fake_root(tmp_path, {
        "/proc/self/cgroup": "0::/limited.slice/epd.service\n",
        "/proc/self/mountinfo": V2_ROOT + "\n",
        "/sys/fs/cgroup/limited.slice/epd.service/cpu.max": "300000 100000\n",
        "/sys/fs/cgroup/limited.slice/cpu.max": "200000 100000\n",
        # /sys/fs/cgroup/cpu.max is absent, as on a real root cgroup
    })
    assert read_cpu_limit(root) == CpuLimit(2.0, "/sys/fs/cgroup/limited.slice/cpu.max")
    workers, note = auto_workers(root)
    cpus = available_cpus()
    assert workers == min(2, cpus)
    assert note == (f"--workers auto: {workers} (CPU limit 2 in "
                    f"/sys/fs/cgroup/limited.slice/cpu.max, {cpus} CPU{'s' * (cpus != 1)} "
                    "to run on)")


def test_without_cgroup_files_there_is_no_limit_and_one_worker(tmp_path: Path) -> None:
    assert read_cpu_limit(str(tmp_path)) is None
    assert auto_workers(str(tmp_path)) == (
        1, "--workers auto: 1 (no CPU limit found in this process's cgroup)")
