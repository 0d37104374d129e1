"""The project's dependencies, and those of the extras named, as pip requirement lines.

    python3 deploy/container/requirements.py pyproject.toml otel,kubeconfig
    python3 deploy/container/requirements.py pyproject.toml --build-system

Why: the image installs its dependencies in a layer of their own, built from ``pyproject.toml``
alone, so that a change to the code rebuilds only the small layer of the wheel, and the
dependencies come from the one list the package itself declares (no second copy to drift).
An extra the project does not have is an error, not a silently smaller image (pip only warns).
Runs on the base image's own Python (3.11 or newer: ``tomllib``), with nothing installed.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

#: The extras an image may carry: the optional features of the running proxy (the others are
#: development tools: tests, plots, the asyncio bridge for embedding).
IMAGE_EXTRAS = ("otel", "kubeconfig")


def requirement_lines(pyproject: dict, extras: Sequence[str]) -> list[str]:
    """``project.dependencies`` then each named extra's, in order, without repeats."""
    project = pyproject["project"]
    unknown = [name for name in extras if name not in IMAGE_EXTRAS]
    if unknown:
        raise ValueError(f"unknown extra {unknown[0]!r}: the image takes "
                         f"{', '.join(IMAGE_EXTRAS)} (comma-separated)")
    lines = list(project["dependencies"])
    for name in extras:
        lines += [line for line in project["optional-dependencies"][name] if line not in lines]
    return lines


def parse_extras(text: str) -> list[str]:
    """``"otel, kubeconfig"`` -> ``["otel", "kubeconfig"]``; empty parts are dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path(argv[0]).read_text())
    if argv[1:] == ["--build-system"]:  # what building the wheel needs (no build isolation)
        print("\n".join(pyproject["build-system"]["requires"]))
        return 0
    try:
        lines = requirement_lines(pyproject, parse_extras(argv[1] if len(argv) > 1 else ""))
    except ValueError as exc:
        print(f"requirements.py: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
