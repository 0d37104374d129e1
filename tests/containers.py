"""Podman on these machines, for the image's suite (``tests/container``): the flags, the
session's image, and a podman call.

Podman's flags, and why each (measured on these machines, ``../shared/STACK-NOTES.md``):

- ``--runtime runc``: Debian's podman may pick crun, which was not tried with the flags below;
- ``--ulimit nofile=1024:1024 --ulimit nproc=1024:1024``: this sandbox may not raise limits
  (no ``CAP_SYS_RESOURCE``), and podman's defaults would have it raise them; lower limits run.
  A test's proxy needs no more than 1024 descriptors;
- ``--network host``: the fake vLLM servers listen on the host's loopback, and the proxy in the
  container reaches them there (and the tests reach it);
- at build, ``-v /etc/ssl/certs:/etc/ssl/certs:ro``: pip reaches the package registry through
  a proxy whose certificate authority only the host trusts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "deploy" / "container" / "build"
REQUIREMENTS = ROOT / "deploy" / "container" / "requirements.py"
#: The extras of the suite's second image (the first has none).
EXTRAS = "otel,kubeconfig"
#: The base made from Debian's packages (``deploy/container/build --debian-base``).
DEBIAN_BASE = "localhost/debian-python:bookworm"
#: The session's image: a tag of its own, so a test run never replaces a user's epd-trio tag.
IMAGE = "localhost/epd-trio:test"
RUNTIME = ["--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
RUN_FLAGS = [*RUNTIME, *LIMITS, "--network", "host"]
BUILD_FLAGS = [*RUN_FLAGS, "--volume", "/etc/ssl/certs:/etc/ssl/certs:ro"]


@dataclass(frozen=True)
class Image:
    name: str
    #: Bytes, as ``podman image inspect`` reports them (uncompressed layers).
    size: int


def test_venv_pins(path: Path) -> Path:
    """Write to ``path`` the versions this test venv has of the image's dependencies (both
    extras' too), as ``deploy/container/build --constraints`` takes them: so the images the
    suite builds hold what the main suite ran with, and the build's dependency layer is
    rebuilt when the venv's resolution changed (not reused from an older build for ever)."""
    done = subprocess.run([sys.executable, str(REQUIREMENTS), str(ROOT / "pyproject.toml"),
                           EXTRAS, "--installed"], capture_output=True, text=True, check=True)
    path.write_text(done.stdout)
    return path


def versions_in(image: str) -> dict[str, str]:
    """Every distribution in the image's venv: canonical name -> version."""
    probe = ("import importlib.metadata as m, json, re; print(json.dumps({re.sub(r'[-_.]+', "
             "'-', d.metadata['Name']).lower(): d.version for d in m.distributions()}))")
    done = podman("run", "--rm", *RUN_FLAGS, "--entrypoint", "python3", image, "-c", probe)
    return json.loads(done.stdout)


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman ARGS``, its output captured as text (raises on failure unless ``check``)."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check)


async def podman_async(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman`` from a Trio test: the fakes in its nursery go on serving meanwhile."""
    return await trio.to_thread.run_sync(lambda: podman(*args, check=check))


def cannot_run_containers(flags: tuple[str, ...] = tuple(RUN_FLAGS)) -> str | None:
    """Why podman cannot run a container on this machine with ``flags``, or None when it can.

    Asked before anything is made (the Debian base takes tens of seconds, and a machine that
    cannot run containers would fail there with a message about the base). Needs no image:
    ``podman info`` (the storage and the runtime are set up), then ``true`` run with the
    suite's flags in a container whose root is an empty directory with the host's ``/usr``
    mounted read-only (``--rootfs``), ``/bin`` and ``/lib`` linked or mounted as the host has
    them. That run goes through everything a test's does: namespaces, cgroups, the runtime,
    the limits this sandbox may not raise."""
    info = podman("info", check=False)
    if info.returncode != 0:
        return f"podman info: {info.stderr.strip()[-500:]}"
    with tempfile.TemporaryDirectory(prefix="epd-trio-probe-") as rootfs:
        mounts = ["--volume", "/usr:/usr:ro"]
        Path(rootfs, "usr").mkdir()
        for name in ("bin", "sbin", "lib", "lib64"):
            host = Path("/", name)
            if host.is_symlink():  # merged /usr (Debian 12): bin -> usr/bin
                Path(rootfs, name).symlink_to(os.readlink(host))
            elif host.is_dir():
                Path(rootfs, name).mkdir()
                mounts += ["--volume", f"{host}:{host}:ro"]
        run = podman("run", "--rm", *flags, *mounts, "--rootfs", rootfs, "true", check=False)
    if run.returncode != 0:
        return f"podman run true: {run.stderr.strip()[-500:]}"
    return None
