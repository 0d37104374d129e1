"""The image, built from ``deploy/container/Containerfile`` and run with podman against fake vLLM
servers on the host's loopback (marker ``container``: ``python -m pytest -m container``, after
the main suite in ``.ci/run``; docs/contributing/tests.md).

What a container changes, checked here and nowhere else: the image is what the manifests were
checked against (``tests/image_facts.py``); the proxy answers as it does on the host, byte for
byte; it runs as its user on a read-only root with ``/tmp`` its only writable place;
``podman stop`` drains as SIGTERM does on a host (tini passes the signal on); ``--workers
auto`` follows the container's CPU limit; metrics add up over two workers whose files are on
the ``/tmp`` volume.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from epd_trio._serve.cpu_quota import CpuLimit, workers_for
from epd_trio._serve.process import available_cpus
from epd_trio.testing import FakeVLLM

from containers import (
    BUILD,
    BUILD_FLAGS,
    DEBIAN_BASE,
    EXTRAS,
    LIMITS,
    RUN_FLAGS,
    RUNTIME,
    Image,
    cannot_run_containers,
    podman,
    podman_async,
    versions_in,
)
from helpers import (
    CHAT,
    Samples,
    ServerProcess,
    chat_body,
    image,
    poll_until,
    requests_per_worker,
    scrape,
    server_process,
    start_fakes,
)
from image_facts import ROOT, containerfile_facts
from real_servers import missing, require_binary

pytestmark = pytest.mark.container

#: The read-only root of a pod: nothing writable but a tmpfs at /tmp (``--read-only`` alone
#: would also mount podman's own tmpfs on /run and /var/tmp).
READ_ONLY = ["--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,size=64m"]
#: What a container starts with and exits for, at most (a slow machine: imports, spawns).
START_LIMIT = 60.0


@dataclass
class Running:
    """A container started by ``container``: its name, and the ``podman run`` serving it (its
    stderr is the proxy's)."""

    name: str
    served: ServerProcess

    @property
    def url(self) -> str:
        """The proxy's URL from the host (it listens on 0.0.0.0 in the host's network)."""
        return self.served.url.replace("0.0.0.0", "127.0.0.1")

    @property
    def log(self) -> bytearray:
        return self.served.log

    @property
    def process(self) -> trio.Process:
        return self.served.process

    async def whole_log(self) -> bytes:
        """Its stderr once it ended (the container exited, or was removed): all of it. Why
        wait: the drain task may not have read the last lines yet when ``podman run`` exits."""
        return await self.served.whole_log()

    @staticmethod
    def lines(log: bytes) -> list[dict[str, Any]]:
        """The JSON log lines (``--log-format json``) of ``log``."""
        return [orjson.loads(line) for line in log.splitlines() if line.startswith(b"{")]


@asynccontextmanager
async def container(nursery: trio.Nursery, built: Image, *args: str,
                    options: tuple[str, ...] = ()) -> AsyncIterator[Running]:
    """``podman run`` the image (attached: its stderr is the proxy's), ``--port 0`` then
    ``args`` after the entrypoint; yields once the proxy listens. Removed on the way out.

    Served by ``helpers.server_process`` like ``epd-trio serve`` on the host, with one
    difference: it is stopped by ``podman rm --force`` on its name, not by a signal to the
    ``podman run`` client, which would leave the container running were the client killed."""
    name = f"epd-trio-test-{uuid.uuid4().hex[:8]}"
    command = ["podman", "run", "--rm", "--name", name, *RUN_FLAGS, *options, built.name,
               "--port", "0", *args]
    async with server_process(nursery, command, dict(os.environ), limit=START_LIMIT,
                              stop=removing(name)) as served:
        yield Running(name, served)


def removing(name: str) -> Callable[[trio.Process], Awaitable[None]]:
    """How ``server_process`` ends the container ``name``: ``podman rm --force``, then the
    ``podman run`` client's exit."""

    async def remove(process: trio.Process) -> None:
        with trio.CancelScope(shield=True):
            await trio.run_process(["podman", "rm", "--force", "--time", "0", name],
                                   capture_stdout=True, capture_stderr=True, check=False)
            await process.wait()

    return remove


async def until_ready(url: str) -> None:
    """``/ready`` is 503 until every role has answered a probe: ask until it is 200."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:

        async def ready() -> bool:
            return (await client.get(url + "/ready")).status_code == 200

        await poll_until(ready, 30)


# -- the process inside, seen from the host --------------------------------------------------------

def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


async def process_tree(name: str) -> list[int]:
    """The container's processes, PID 1 (tini) first, as host process ids."""
    tree = [int((await podman_async("inspect", "--format", "{{.State.Pid}}", name)).stdout)]
    for pid in tree:
        tree += children(pid)
    return tree


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


async def ids_inside(name: str, pid: int) -> tuple[set[int], set[int]]:
    """A process's real, effective, saved and file-system user and group ids as the container
    sees them (``pid``: its id there). Read inside, not from the host's ``/proc``: under
    rootless podman the host sees the ids the user namespace maps them to (a subordinate
    range), not the image's 10001."""
    status = (await podman_async("exec", name, "cat", f"/proc/{pid}/status")).stdout

    def field(which: str) -> set[int]:
        return {int(n) for n in re.search(rf"^{which}:\s+(.*)$", status, re.M).group(1).split()}

    return field("Uid"), field("Gid")


def mount(pid: int, point: str) -> tuple[str, str]:
    """(mount options, file-system type) of ``point`` as the process sees it."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == point:
            return fields[5], fields[fields.index("-") + 1]
    raise AssertionError(f"{point} is not a mount point of process {pid}")


def pid_inside(pid: int) -> int:
    """The process id that the process has in its container's namespace."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^NSpid:.*\s(\d+)$", status, re.M).group(1))


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


# -- the tests ---------------------------------------------------------------------------------------

def test_the_probe_says_why_a_container_cannot_run() -> None:
    """The suite's first question (``conftest.built``) can answer no, with podman's reason:
    here, a runtime that does not exist."""
    require_binary("podman")
    if (why := cannot_run_containers()) is not None:
        missing(f"this machine cannot run containers ({why})")
    reason = cannot_run_containers((*RUN_FLAGS, "--runtime", "/nonexistent/runc"))
    assert reason is not None and reason.startswith("podman run true: ")
    assert "/nonexistent/runc" in reason



def test_the_image_is_what_the_manifests_were_checked_against(
    built: Image, observe: Callable[[str], None]
) -> None:
    facts = containerfile_facts()
    config = orjson.loads(podman("image", "inspect", "--format", "{{json .Config}}",
                                 built.name).stdout)
    assert config["User"] == facts.user
    assert set(config["ExposedPorts"]) == {f"{facts.port}/tcp"}
    assert config["Entrypoint"] == list(facts.entrypoint)
    assert config["StopSignal"] == facts.stop_signal
    env = dict(pair.split("=", 1) for pair in config["Env"])
    assert env["TMPDIR"] == facts.env["TMPDIR"] and env["PATH"].startswith("/opt/epd-trio/bin:")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]
    assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == head
    assert labels["org.opencontainers.image.base.name"] == DEBIAN_BASE
    assert labels["org.opencontainers.image.title"] == "epd-trio"
    origin = subprocess.run(["git", "-C", str(ROOT), "remote", "get-url", "origin"],
                            capture_output=True, text=True, check=False)
    assert labels["org.opencontainers.image.source"] == (
        origin.stdout.strip() if origin.returncode == 0 else "unknown")
    version = podman("run", "--rm", *RUN_FLAGS, built.name, "--version").stdout
    assert version == f"epd-trio {project['version']}\n"
    # The runtime stage holds the venv and nothing of the build: no pip, no wheel, no source.
    inside = podman("run", "--rm", *RUN_FLAGS, "--entrypoint", "sh", built.name, "-c",
                    "ls /opt; ls /opt/epd-trio/bin; ls -d /wheels /src /opt/build 2>&1; "
                    "python3 -c 'import importlib.util as u; print(u.find_spec(\"pip\"))'; "
                    "command -v python3; id -u").stdout.split("\n")
    assert inside[0] == "epd-trio"
    assert not [name for name in inside if name.startswith("pip")]
    assert sum("No such file or directory" in line for line in inside) == 3
    assert inside[-4:] == ["None", "/opt/epd-trio/bin/python3", str(facts.uid), ""]
    observe(f"{built.size / 1e6:.0f} MB; entrypoint {' '.join(facts.entrypoint)}")


def assert_the_test_venvs_versions(in_image: dict[str, str]) -> None:
    """Every distribution of the image's venv but the proxy itself is at the version this test
    venv has (the build's ``--constraints``): the image runs what the main suite ran."""
    here = {re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower(): dist.version
            for dist in importlib.metadata.distributions()}
    differ = {name: (version, here.get(name)) for name, version in in_image.items()
              if name != "epd-trio" and here.get(name) != version}
    assert not differ, f"(in the image, in the test venv): {differ}"
    assert len(in_image) > 20 and "epd-trio" in in_image


def test_the_image_holds_the_versions_the_tests_ran_with(built: Image) -> None:
    assert_the_test_venvs_versions(versions_in(built.name))


async def test_it_answers_byte_for_byte_as_without_the_container(
    nursery: trio.Nursery, built: Image
) -> None:
    """The same requests through ``epd-trio serve`` on the host, then through the container:
    each answer is the bytes decode sent, and every leg each fake received is the same."""
    encode, prefill, decode = (FakeVLLM("encode"), FakeVLLM("prefill", dp_size=2),
                               FakeVLLM("decode", dp_size=2))
    fakes = await start_fakes(nursery, encode, prefill, decode)
    flags = ["--encode", encode.url, "--prefill", f"{prefill.url}#dp=2",
             "--decode", f"{decode.url}#dp=2"]
    bodies = [chat_body(image(1), stream=True), chat_body(image(2)),
              chat_body(image(3), stream=True, max_tokens=3)]

    async def through(url: str) -> list[list[tuple[str, str, int | None, Any, dict[str, str]]]]:
        await until_ready(url)
        legs = []
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            for n, body in enumerate(bodies):
                seen = [len(fake.requests()) for fake in fakes]
                r = await client.post(url + CHAT, json=body, headers={"x-request-id": f"r{n}"})
                assert r.status_code == 200, r.text
                assert r.content == bytes(decode.requests()[-1].sent)  # relayed as decode sent
                assert r.headers["content-type"].startswith(
                    "text/event-stream" if body.get("stream") else "application/json")
                legs.append([(fake.role, rec.path, rec.rank, rec.body, rec.headers)
                             for fake, before in zip(fakes, seen, strict=True)
                             for rec in fake.requests()[before:]])
        return legs

    command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", *flags]
    async with server_process(nursery, command, env=dict(os.environ)) as host:
        on_host = await through(host.url)
    async with container(nursery, built, *flags) as inside:
        in_container = await through(inside.url)
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            health = await client.get(inside.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    assert [[role for role, *_ in request] for request in in_container] == [
        ["encode", "prefill", "decode"]] * len(bodies)
    assert in_container == on_host


async def test_the_proxy_runs_as_its_user_on_a_read_only_root(
    nursery: trio.Nursery, built: Image
) -> None:
    facts = containerfile_facts()
    async with container(nursery, built, "--decode", "http://127.0.0.1:9", "--workers", "1",
                         options=tuple(READ_ONLY)) as inside:
        tini, *rest = await process_tree(inside.name)
        assert cmdline(tini)[:2] == ["tini", "--"]
        (proxy,) = rest
        assert cmdline(proxy)[1:3] == ["/opt/epd-trio/bin/epd-trio", "serve"]
        assert pid_inside(tini) == 1
        for pid in (tini, proxy):
            assert await ids_inside(inside.name, pid_inside(pid)) == ({facts.uid}, {facts.gid})
        options, _ = mount(proxy, "/")
        assert "ro" in options.split(",")
        options, fs_type = mount(proxy, "/tmp")
        assert "rw" in options.split(",") and fs_type == "tmpfs"
        touched = await podman_async("exec", inside.name, "sh", "-c",
                                     "touch /probe || echo refused", check=False)
        assert "Read-only file system" in touched.stderr and "refused" in touched.stdout


@pytest.mark.parametrize("workers", [1, 2])
async def test_podman_stop_drains_a_stream_then_ends_it_with_an_error_event(
    nursery: trio.Nursery, built: Image, observe: Callable[[str], None], tmp_path: Path,
    workers: int,
) -> None:
    """A 10 s stream in flight when ``podman stop`` sends SIGTERM: it goes on for
    ``EPD_SHUTDOWN_GRACE`` (2 s), then ends with the ``shutting_down`` event; the container
    exits 0 well before podman's SIGKILL; the request is logged as ``shutdown``, not as a
    client that left (499). With one worker (the proxy is tini's child) and with two, as the
    manifest runs it (tini's child is the parent, which stops its workers): then the parent
    removed the workers' metrics directory before it exited.

    ``/tmp`` is a host directory here, not a tmpfs, so that what the proxy left in it is
    still there to look at once the container is gone."""
    grace = 2.0
    decode = FakeVLLM("prefill_decode")
    decode.behaviour.tokens, decode.behaviour.chunk_delay = 100, 0.1  # a 10 s stream
    await start_fakes(nursery, decode)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # as /tmp: the image's user writes there
    options = ("--env", f"EPD_SHUTDOWN_GRACE={grace:g}", "--read-only",
               "--read-only-tmpfs=false", "--volume", f"{tmp}:/tmp:rw")
    async with container(nursery, built, "--decode", decode.url, "--request-log",
                         "--log-format", "json", "--access-log", "--workers", str(workers),
                         options=options) as inside:
        await until_ready(inside.url)
        # --workers N keeps its metrics files in a directory of its own there; one alone, none.
        assert len(list(tmp.glob("epd-trio-metrics-*"))) == (workers > 1)
        stop_timeout = 30
        stopped: list[subprocess.CompletedProcess[bytes]] = []

        async def stop() -> None:
            stopped.append(await trio.run_process(
                ["podman", "stop", "--time", str(stop_timeout), inside.name],
                capture_stdout=True, capture_stderr=True, check=False))

        events: list[tuple[float, bytes]] = []
        # The nursery ends when `podman stop` has returned (it may return after `run` does).
        async with trio.open_nursery() as stopping:
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client, client.stream(
                    "POST", inside.url + CHAT, json=chat_body(stream=True, max_tokens=100),
                    headers={"x-request-id": "cut"}) as r:
                assert r.status_code == 200
                chunks = r.aiter_bytes()
                events.append((trio.current_time(), await anext(chunks)))
                signalled = trio.current_time()
                stopping.start_soon(stop)
                async for chunk in chunks:
                    events.append((trio.current_time(), chunk))
            ended = trio.current_time()
            with trio.fail_after(stop_timeout):
                status = await inside.process.wait()
            exited = trio.current_time()
    text = b"".join(chunk for _, chunk in events).decode()
    frames = text.strip().split("\n\n")
    assert frames[-1].startswith("data: {"), text[-500:]
    error = orjson.loads(frames[-1].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and "[DONE]" not in text
    tokens = sum('"content":"' in frame for frame in frames)
    assert 0 < tokens < 100  # cut, not finished
    after_signal = [at for at, _ in events if at > signalled]
    assert len(after_signal) > 2  # the stream went on after the signal: the grace
    assert ended - signalled >= grace  # the stop was sent after `signalled`, the grace after it
    assert status == 0 and stopped[0].returncode == 0  # SIGKILL would be 137
    assert list(tmp.glob("epd-trio-metrics-*")) == []  # removed before the proxy exited
    lines = inside.lines(await inside.whole_log())
    assert any(f"SIGTERM: shutting down (shutdown grace {grace:g} s)" in str(line.get("message"))
               for line in lines)  # tini passed podman's SIGTERM on to the proxy
    (request,) = [line for line in lines if line.get("logger") == "epd_trio.requests"]
    assert (request["request_id"], request["outcome"], request["status"]) == (
        "cut", "shutdown", 200)  # not "cancelled" 499, as for a client that left
    (access,) = [line for line in lines if line.get("logger") == "epd_trio.access"
                 and line["request_id"] == "cut"]
    assert access["status"] == 200
    observe(f"--workers {workers}: SSE error {ended - signalled:.1f} s after podman stop "
            f"(grace {grace:g} s), "
            f"{tokens} tokens relayed; container exited {exited - signalled:.1f} s after it, "
            "status 0")


async def test_metrics_add_up_over_two_workers_whose_files_are_on_the_tmp_volume(
    nursery: trio.Nursery, built: Image, observe: Callable[[str], None]
) -> None:
    """``--workers 2`` on the read-only root: both workers serve (each one's own counter file
    on the ``/tmp`` tmpfs counts requests), and every scrape, whichever worker answers, adds
    both files up to what was sent."""
    decode = FakeVLLM("prefill_decode", dp_size=2)
    await start_fakes(nursery, decode)
    burst = 20
    async with container(nursery, built, "--decode", f"{decode.url}#dp=2", "--workers", "2",
                         options=tuple(READ_ONLY)) as inside:
        assert b"(PD, 2 workers) listening on" in inside.log
        _tini, _proxy, *rest = await process_tree(inside.name)
        workers = [pid for pid in rest if "multiprocessing.spawn" in " ".join(cmdline(pid))]
        assert len(workers) == 2
        (directory,) = {environ(pid)["PROMETHEUS_MULTIPROC_DIR"] for pid in workers}
        assert directory.startswith("/tmp/epd-trio-metrics-")
        assert mount(workers[0], "/tmp")[1] == "tmpfs" and "ro" in mount(workers[0], "/")[0]
        files = f"/proc/{workers[0]}/root{directory}"  # the tmpfs, seen from the host

        async def fresh_scrape() -> Samples:
            # A fresh connection each time, so that either worker may answer.
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                return await scrape(client, inside.url)

        async def one(k: int) -> None:
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                r = await client.post(inside.url + CHAT, json=chat_body(stream=k % 2 == 0))
                assert r.status_code == 200

        def ok(m: Samples) -> float:
            return m.get("epd_trio_requests_total", endpoint=CHAT, outcome="ok", model="fake-model")

        # Which worker accepts a connection is the kernel's choice: bursts of concurrent
        # requests on fresh connections, until each worker has served some (one burst, as a
        # rule; at most five).
        sent = 0

        async def all_counted() -> bool:
            return ok(await fresh_scrape()) >= sent

        for _ in range(5):
            async with trio.open_nursery() as requests:
                for k in range(burst):
                    requests.start_soon(one, k)
            sent += burst
            await poll_until(all_counted, 10)  # counted just after a request's last byte
            per_worker = requests_per_worker(files)
            if len(per_worker) == 2 and all(per_worker.values()):
                break
        # Each worker's file (named by its process id inside the container) carries its own.
        assert set(per_worker) == {pid_inside(pid) for pid in workers}
        assert all(per_worker.values()), per_worker
        assert sum(per_worker.values()) == sent
        for _ in range(6):
            m = await fresh_scrape()
            assert ok(m) == sent
            assert m.by("epd_trio_dp_rank_requests_total", "rank", role="decode",
                        upstream=decode.url) == {"0": sent / 2, "1": sent / 2}
    observe(f"{sent} requests served by 2 workers: {sorted(per_worker.values())}")


async def test_workers_auto_follows_the_containers_cpu_limit(
    nursery: trio.Nursery, built: Image, observe: Callable[[str], None]
) -> None:
    """The image passes ``--workers auto``: under ``--cpus`` the proxy starts one worker per
    CPU of the quota, naming the cgroup file it read; without a limit, one."""
    cpus = min(2, available_cpus())
    expected = workers_for(CpuLimit(cpus, ""), available_cpus())
    async with container(nursery, built, "--decode", "http://127.0.0.1:9",
                         options=("--cpus", str(cpus))) as inside:
        pass
    log = (await inside.whole_log()).decode()
    note = re.search(r"--workers auto: (\d+) \(CPU limit ([\d.]+) in (\S+), [^)]*\)", log)
    assert note, log
    assert (int(note.group(1)), float(note.group(2))) == (expected, cpus)
    # cgroup v2, or v1 (this machine): the container's own cgroup, at the root of the mount.
    assert note.group(3) in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                             "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")
    plural = "s" if expected != 1 else ""
    assert f"(PD, {expected} worker{plural}) listening on" in log
    async with container(nursery, built, "--decode", "http://127.0.0.1:9") as inside:
        pass
    log = (await inside.whole_log()).decode()
    assert "--workers auto: 1 (no CPU limit found in this process's cgroup)" in log
    observe(f"--cpus {cpus}: {note.group(0)}")


def documented_run(page: Path) -> list[str]:
    """The arguments of the one ``podman run`` line in ``page``'s shell blocks."""
    lines = [line for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
             for line in block.splitlines() if "podman run " in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].split("podman run ", 1)[1])


@pytest.mark.parametrize("page", ["README.md", "docs/how-to/kubernetes.md"])
async def test_the_documented_podman_run_serves_as_the_page_says(
    nursery: trio.Nursery, built: Image, page: str
) -> None:
    """The pages' ``podman run`` line, its flags as written (a published port, a read-only
    root with a tmpfs at ``/tmp``, ``--cpus 2``): it serves on the published port, on a
    read-only root, with the workers ``--cpus 2`` gives. Changed: the image is the session's
    (the pages' ``epd-trio`` is what ``deploy/container/build`` tags, built here on the
    Debian base), the host's side of ``-p`` is a free port, and the runtime and limits this
    sandbox needs are added (``tests/containers.py``). The vLLM address stays the page's,
    which resolves nowhere here: ``/health`` answers, ``/ready`` would not."""
    args = documented_run(ROOT / page)
    image_at = args.index("epd-trio")
    flags, proxy_args = args[:image_at], args[image_at + 1:]
    published = flags.index("-p") + 1
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    inner = flags[published].rpartition(":")[2]
    flags[published] = f"{port}:{inner}"
    name = f"epd-trio-test-{uuid.uuid4().hex[:8]}"
    command = ["podman", "run", "--name", name, *RUNTIME, *LIMITS, *flags, built.name,
               *proxy_args]
    cpus = float(flags[flags.index("--cpus") + 1])
    expected = workers_for(CpuLimit(cpus, ""), available_cpus())
    async with server_process(nursery, command, dict(os.environ), limit=START_LIMIT,
                              stop=removing(name)) as served:
        assert served.url == f"http://0.0.0.0:{inner}"
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            health = await client.get(f"http://127.0.0.1:{port}/health")
        assert health.status_code == 200
        assert [i["url"] for i in health.json()["roles"]["decode"]] == ["http://d0:8000"]
        touched = await podman_async("exec", name, "sh", "-c", "touch /probe; touch /tmp/probe",
                                     check=False)
        assert "Read-only file system" in touched.stderr and "/tmp" not in touched.stderr
    log = (await served.whole_log()).decode()
    assert f"--workers auto: {expected} (CPU limit {cpus:g} in " in log


async def test_two_workers_on_a_read_only_root_without_tmp_say_what_to_mount(
    built: Image,
) -> None:
    done = await trio.run_process(
        ["podman", "run", "--rm", *RUN_FLAGS, "--read-only", "--read-only-tmpfs=false",
         built.name, "--workers", "2", "--port", "0", "--decode", "http://127.0.0.1:9"],
        capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 2
    last = done.stderr.decode().strip().splitlines()[-1]
    assert "--workers N keeps its metrics in a directory of its own in a temporary directory, " \
           "and found none writable" in last
    assert "mount a writable volume at /tmp" in last and "Traceback" not in done.stderr.decode()


def test_a_stop_during_start_up_ends_the_container_at_once(
    built: Image, observe: Callable[[str], None]
) -> None:
    """Why tini is PID 1: the proxy as PID 1 ignores SIGTERM until its handler is installed,
    after its imports, and podman then waits for its SIGKILL (exit 137). Under tini the signal
    ends the starting proxy (143), or the started one drains (0)."""
    name = f"epd-trio-test-{uuid.uuid4().hex[:8]}"
    podman("run", "--detach", "--name", name, *RUN_FLAGS, built.name, "--port", "0",
           "--decode", "http://127.0.0.1:9")
    try:
        started = time.monotonic()
        podman("stop", "--time", "30", name)
        took = time.monotonic() - started
        status = int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout)
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)
    assert status in (0, 143), f"exit status {status}: the SIGTERM was not acted on"
    observe(f"stopped right after start: exit {status} after {took:.1f} s")


async def test_the_extras_are_chosen_at_build(
    nursery: trio.Nursery, built: Image, pins: Path, observe: Callable[[str], None]
) -> None:
    """``EXTRAS`` (``deploy/container/build --extras``) adds the optional features' packages;
    without it the image has neither, and tracing asked of it stops the start with one line.
    Built with the same script, under a tag of its own."""
    tag = f"{built.name}-extras"
    started = trio.current_time()
    done = await trio.run_process([str(BUILD), "--debian-base", "--extras", EXTRAS,
                                   "--constraints", str(pins), "--tag", tag, "--", *BUILD_FLAGS],
                                  capture_stdout=True, capture_stderr=True, check=False)
    took = trio.current_time() - started
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    probe = ("import importlib.util as u; "
             "print(*(bool(u.find_spec(m)) for m in ('opentelemetry', 'yaml')))")
    for name, expected, extras in ((built.name, "False False", ""), (tag, "True True", EXTRAS)):
        found = await podman_async("run", "--rm", *RUN_FLAGS, "--entrypoint", "python3", name,
                                   "-c", probe)
        assert found.stdout.strip() == expected, name
        labels = orjson.loads((await podman_async(
            "image", "inspect", "--format", "{{json .Config.Labels}}", name)).stdout)
        assert labels["io.epd-trio.extras"] == extras
    assert_the_test_venvs_versions(await trio.to_thread.run_sync(versions_in, tag))
    otlp = ("--env", "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:9")
    refused = await podman_async("run", "--rm", *RUN_FLAGS, *otlp, built.name, "--port", "0",
                                 "--decode", "http://127.0.0.1:9", check=False)
    assert refused.returncode == 2
    assert "the OpenTelemetry SDK is missing" in refused.stderr
    size = int((await podman_async("image", "inspect", "--format", "{{.Size}}", tag)).stdout)
    async with container(nursery, Image(tag, size), "--decode", "http://127.0.0.1:9",
                         options=otlp) as run:
        # Said just after the listening line, by the serving process: a line to wait for.
        await poll_until(lambda: b"tracing on: OTLP/HTTP to http://127.0.0.1:9/v1/traces"
                         in run.log, 30)
    observe(f"--extras otel,kubeconfig: {size / 1e6:.0f} MB, built in {took:.0f} s")
