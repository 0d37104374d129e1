"""The image's suite (marker ``container``): the image built once per session with the build
script anyone runs (``deploy/container/build``), on a base made from Debian's packages, and what
the tests observed, printed at the end of the session (sizes, times).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from containers import (
    BUILD,
    BUILD_FLAGS,
    DEBIAN_BASE,
    IMAGE,
    Image,
    cannot_run_containers,
    podman,
    test_venv_pins,
)
from real_servers import missing, require_binary, require_one_process
from session_notes import SessionNotes

NOTES = SessionNotes("observed on the image", "container")


@pytest.fixture(scope="session")
def pins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build's constraints: the versions the test venv has (``test_venv_pins``)."""
    return test_venv_pins(tmp_path_factory.mktemp("image") / "pins.txt")


@pytest.fixture(scope="session")
def built(request: pytest.FixtureRequest, pins: Path) -> Iterator[Image]:
    """The image, built from this checkout's Containerfile by ``deploy/container/build``.

    First the machine is asked whether it runs containers at all (``cannot_run_containers``:
    no image needed). A machine without podman, or one where podman cannot run a container,
    skips the suite locally and fails it under ``CI=true`` (``tests/real_servers.py``), saying
    why. A build that fails on a machine that runs containers is a failure everywhere: the
    Containerfile's fault, or the build script's."""
    require_one_process("image's suite")
    say = NOTES.say(request.config)
    require_binary("podman")
    reason = cannot_run_containers()
    if reason is not None:
        missing(f"this machine cannot run containers ({reason})")
    if podman("image", "exists", DEBIAN_BASE, check=False).returncode != 0:
        require_binary("mmdebstrap")
        say(f"making {DEBIAN_BASE} from Debian's packages (once per machine)")
    started = time.monotonic()
    base = subprocess.run([str(BUILD), "--debian-base", "--base-only"], capture_output=True,
                          text=True, check=False)
    assert base.returncode == 0, f"making the base failed:\n{base.stdout}{base.stderr}"
    built = subprocess.run([str(BUILD), "--debian-base", "--constraints", str(pins),
                            "--tag", IMAGE, "--", *BUILD_FLAGS],
                           capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    assert built.returncode == 0, f"the build failed:\n{built.stdout[-6000:]}{built.stderr[-6000:]}"
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    made = f"image {IMAGE}: {size / 1e6:.0f} MB (FROM {DEBIAN_BASE}); made in {seconds:.0f} s"
    said = [line for line in (base.stderr + built.stderr).splitlines() if line.startswith("build:")]
    NOTES.lines(request.config).extend([made, *said])
    say(made)
    yield Image(IMAGE, size)
    pruned = prune_dangling_images()
    NOTES.lines(request.config).append(
        f"pruned {len(pruned)} dangling image(s) of earlier epd-trio builds")


def prune_dangling_images() -> list[str]:
    """Remove the images earlier builds of epd-trio left untagged; their ids.

    Why: each build after a change to the code leaves the previous image untagged ("dangling",
    about 60 MB of its own: its copy of the venv), and CI's disk would grow with every run.
    Why only these (``label=org.opencontainers.image.title=epd-trio``, a label only the
    runtime stage's last steps carry): the build stage's last image is dangling too, and is
    the cache of the next build (its dependencies' layer); a plain ``podman image prune``
    would remove it, and the next build would install every dependency again. Other
    projects' images are not this suite's to remove."""
    done = podman("image", "prune", "--force", "--filter",
                  "label=org.opencontainers.image.title=epd-trio")
    return done.stdout.split()


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record what a test measured; printed in the session's summary."""
    return NOTES.recorder(request)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    NOTES.summary(terminalreporter)
