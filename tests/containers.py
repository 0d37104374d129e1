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

import subprocess
from dataclasses import dataclass
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "deploy" / "container" / "build"
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


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman ARGS``, its output captured as text (raises on failure unless ``check``)."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check)


async def podman_async(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman`` from a Trio test: the fakes in its nursery go on serving meanwhile."""
    return await trio.to_thread.run_sync(lambda: podman(*args, check=check))
