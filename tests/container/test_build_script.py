"""``deploy/container/build`` run against a stand-in for podman and docker (main suite: nothing is
built): the command it would run, flag by flag.

Why: the image's suite runs the script with podman only, and only as CI calls it. What a user
runs differently (docker, the default base, the default tags, a tool given as a path) would
otherwise never be run. The stand-in records each call and answers ``image inspect`` as the
real tools do (exit 0: the image exists; ``--format {{.Size}}``: a size).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from image_facts import ROOT

BUILD = ROOT / "deploy" / "container" / "build"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
#: The stand-in: each call's arguments as one JSON line in $STUB_RECORD.
STUB = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STUB_RECORD"], "a") as record:
    record.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["image", "inspect"] and "--format" in sys.argv:
    print(123456789)
"""


def run_build(tmp_path: Path, tool: str, *args: str) -> tuple[subprocess.CompletedProcess[str],
                                                               list[list[str]]]:
    """``deploy/container/build ARGS`` with ``CONTAINER_TOOL`` a stand-in named ``tool``, given
    as a path; its exit, output and the stand-in's calls."""
    stub = tmp_path / "bin" / tool
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(STUB)
    stub.chmod(0o755)
    record = tmp_path / f"{tool}.calls"
    record.unlink(missing_ok=True)
    env = {**os.environ, "CONTAINER_TOOL": str(stub), "STUB_RECORD": str(record)}
    done = subprocess.run([str(BUILD), *args], capture_output=True, text=True, env=env,
                          check=False)
    calls = [json.loads(line) for line in record.read_text().splitlines()] \
        if record.exists() else []
    return done, calls


def options(build: list[str], flag: str) -> list[str]:
    """The values ``flag`` is given in a ``build`` call, in order."""
    return [build[i + 1] for i, arg in enumerate(build) if arg == flag]


def head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("tool", ["podman", "docker"])
def test_the_default_build_and_what_it_passes(tmp_path: Path, tool: str) -> None:
    """What ``deploy/container/build`` alone runs (the README's command): the Containerfile,
    the build's own values as build arguments and labels, both default tags, the context
    last; then the size of the image. Under docker, no ``--ignorefile`` (docker reads
    ``Containerfile.dockerignore`` beside the file by itself)."""
    done, calls = run_build(tmp_path, tool)
    assert done.returncode == 0, done.stderr
    build, inspect = calls
    assert build[:3] == ["build", "--file", "deploy/container/Containerfile"]
    assert build[-1] == "."  # the checkout's root: the script cds there
    args = dict(arg.split("=", 1) for arg in options(build, "--build-arg"))
    assert args["VERSION"] == VERSION
    assert args["REVISION"].removesuffix("-dirty") == head()
    assert (args["EXTRAS"], args["CONSTRAINTS"]) == ("", "")
    assert "BASE" not in args  # the Containerfile's own default: python:3.11-slim-bookworm
    labels = dict(arg.split("=", 1) for arg in options(build, "--label"))
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.revision"] == args["REVISION"]
    assert labels["org.opencontainers.image.base.name"] == "python:3.11-slim-bookworm"
    assert options(build, "--tag") == [f"epd-trio:{VERSION}", "epd-trio:latest"]
    ignore = ["deploy/container/Containerfile.dockerignore"] if tool == "podman" else []
    assert options(build, "--ignorefile") == ignore
    assert inspect == ["image", "inspect", "--format", "{{.Size}}", f"epd-trio:{VERSION}"]
    assert re.search(rf"build: epd-trio:{VERSION} epd-trio:latest built in \d+ s; 123 MB\n$",
                     done.stderr), done.stderr


@pytest.mark.parametrize("tool", ["podman", "docker"])
def test_the_options_the_suite_and_users_give(tmp_path: Path, tool: str) -> None:
    """``--debian-base`` (the base exists: asked, not made), ``--extras``, ``--constraints``
    (comments and blank lines skipped, the pins on one line), ``--tag``, and what follows
    ``--`` passed on before the context."""
    pins = tmp_path / "pins.txt"
    pins.write_text("# from a tested venv\nh11==0.16.0\n\ntrio==0.35.0  # pinned\n")
    done, calls = run_build(tmp_path, tool, "--debian-base", "--extras", "otel,kubeconfig",
                            "--constraints", str(pins), "--tag", "localhost/epd-trio:t",
                            "--", "--network", "host")
    assert done.returncode == 0, done.stderr
    exists, build, _inspect = calls
    assert exists == ["image", "inspect", "localhost/debian-python:bookworm"]
    args = dict(arg.split("=", 1) for arg in options(build, "--build-arg"))
    assert args["BASE"] == "localhost/debian-python:bookworm"
    assert args["EXTRAS"] == "otel,kubeconfig"
    assert args["CONSTRAINTS"] == "h11==0.16.0 trio==0.35.0"
    labels: dict[str, Any] = dict(arg.split("=", 1) for arg in options(build, "--label"))
    assert labels["io.epd-trio.extras"] == "otel,kubeconfig"
    assert labels["org.opencontainers.image.base.name"] == "localhost/debian-python:bookworm"
    assert options(build, "--tag") == ["localhost/epd-trio:t"]
    assert build[-3:] == ["--network", "host", "."]


def test_what_the_build_refuses(tmp_path: Path) -> None:
    """A constraint that is not ``name==version`` (a range, a marker) and an unknown option
    stop the script before anything is built, saying why."""
    pins = tmp_path / "pins.txt"
    pins.write_text("h11>=0.16\n")
    done, calls = run_build(tmp_path, "podman", "--constraints", str(pins))
    assert done.returncode == 2 and calls == []
    assert "--constraints takes name==version lines (pip freeze's form): h11>=0.16" in done.stderr
    done, calls = run_build(tmp_path, "podman", "--no-such")
    assert done.returncode == 2 and calls == [] and "unknown option --no-such" in done.stderr
