"""The project's dependencies, and those of the extras named, as pip requirement lines; or the
versions of them an environment has installed, as constraints.

    python3 deploy/container/requirements.py pyproject.toml otel,kubeconfig
    python3 deploy/container/requirements.py pyproject.toml --build-system
    .venv/bin/python deploy/container/requirements.py pyproject.toml otel,kubeconfig --installed

Why: the image installs its dependencies in a layer of their own, built from ``pyproject.toml``
alone, so that a change to the code rebuilds only the small layer of the wheel, and the
dependencies come from the one list the package itself declares (no second copy to drift).
An extra the project does not have is an error, not a silently smaller image (pip only warns).
Runs on the base image's own Python (3.11 or newer: ``tomllib``), with nothing installed.

``--installed`` prints ``name==version`` for those dependencies and theirs, recursively, as the
Python running it has them installed: the constraints ``deploy/container/build --constraints``
passes into the build, so the image holds the versions a venv was tested with (CI's image suite
pins its image to the test venv this way). Extra lines are harmless (a constraint installs
nothing), so requirement markers other than extras are not evaluated: what is installed counts.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
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


#: A requirement line's parts: its name, its extras, its marker (PEP 508, the forms
#: ``Requires-Dist`` and ``pyproject.toml`` use; a URL requirement has no version to pin).
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?[^;]*(?:;(.*))?$")
_EXTRA_MARKER = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")


def canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503): ``Quart_Trio`` -> ``quart-trio``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(line: str) -> tuple[str, set[str], str]:
    """``hypercorn[trio]>=0.18; python_version < '3.13'`` ->
    (``hypercorn``, {``trio``}, `` python_version < '3.13'``)."""
    found = _REQUIREMENT.match(line)
    if found is None:
        raise ValueError(f"not a requirement: {line!r}")
    name, extras, marker = found.groups()
    named = {canonical(extra.strip()) for extra in (extras or "").split(",") if extra.strip()}
    return canonical(name), named, marker or ""


def pins(roots: Sequence[str], installed: Mapping[str, tuple[str, str, Sequence[str]]]) -> list[str]:
    """``Name==version`` for every distribution ``roots`` (requirement lines) need, and what
    those need in turn, as ``installed`` has them (canonical name -> (its own name, version,
    its ``Requires-Dist`` lines)); sorted by name.

    A requirement under an extra (``; extra == "trio"``) is followed only where that extra was
    asked for (``hypercorn[trio]``); other markers are not evaluated: a requirement whose
    package is not installed is skipped (its marker was false, or it is not needed), and one
    whose package is installed adds a harmless pin. Cycles end where a name was seen."""
    asked: dict[str, set[str]] = {}  # each distribution met, with the extras asked of it
    queue = list(roots)
    while queue:
        name, extras, _ = parse_requirement(queue.pop())
        if name not in installed or (name in asked and extras <= asked[name]):
            continue
        asked[name] = asked.get(name, set()) | extras
        for line in installed[name][2]:
            under = set(map(canonical, _EXTRA_MARKER.findall(parse_requirement(line)[2])))
            if not under or under & asked[name]:
                queue.append(line)
    return sorted(f"{installed[name][0]}=={installed[name][1]}" for name in asked)


def installed_here() -> dict[str, tuple[str, str, list[str]]]:
    """The distributions the running Python has: canonical name -> (name, version, requires)."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        found.setdefault(canonical(name), (name, dist.version, list(dist.requires or [])))
    return found


def main(argv: Sequence[str]) -> int:
    options = [arg for arg in argv if arg.startswith("--")]
    positional = [arg for arg in argv if not arg.startswith("--")]
    if len(positional) not in (1, 2) or len(options) > 1 or options not in (
            [], ["--build-system"], ["--installed"]):
        print(__doc__, file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path(positional[0]).read_text())
    if options == ["--build-system"]:  # what building the wheel needs (no build isolation)
        print("\n".join(pyproject["build-system"]["requires"]))
        return 0
    try:
        extras = parse_extras(positional[1] if len(positional) > 1 else "")
        lines = requirement_lines(pyproject, extras)
    except ValueError as exc:
        print(f"requirements.py: {exc}", file=sys.stderr)
        return 2
    if options == ["--installed"]:
        lines = pins(lines, installed_here())
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
