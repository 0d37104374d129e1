"""What the image says about itself, read from ``deploy/container/Containerfile``: its user, port,
entrypoint, environment, stop signal and labels; and what its entrypoint runs.

Why here: the Kubernetes manifests (``deploy/kubernetes/``, the how-to's) are checked against
these facts in the main suite without building anything (``tests/container/test_manifests.py``,
``tests/test_docs.py``), and the container suite checks that the image podman builds from the
file has exactly these facts (``tests/container/test_image.py``). So a manifest cannot drift
from the image without a test failing: manifest = file (main suite), file = image (CI).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
MANIFESTS = ROOT / "deploy" / "kubernetes" / "epd-trio.yml"


@dataclass(frozen=True)
class ImageFacts:
    """The runtime stage's instructions (the last ``FROM`` onwards), and the ``BASE`` default."""

    base: str
    user: str
    exposed: tuple[str, ...]
    entrypoint: tuple[str, ...]
    env: dict[str, str]
    stop_signal: str
    labels: dict[str, str]

    @property
    def uid(self) -> int:
        return int(self.user.partition(":")[0])

    @property
    def gid(self) -> int:
        return int(self.user.partition(":")[2] or self.user.partition(":")[0])

    @property
    def port(self) -> int:
        (port,) = self.exposed
        return int(port.removesuffix("/tcp"))

    @property
    def command(self) -> tuple[str, ...]:
        """What the entrypoint runs under its init: ``epd-trio serve ...``."""
        init, separator, *rest = self.entrypoint
        assert (init, separator) == ("tini", "--"), self.entrypoint
        return tuple(rest)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) per instruction: comments dropped, continuations joined."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue  # a comment, also one between the lines of a continued instruction
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, rest = pending.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def _pairs(arguments: str) -> dict[str, str]:
    """``KEY=value KEY2="a b"`` (ENV, LABEL) as a dict."""
    return dict(word.split("=", 1) for word in shlex.split(arguments))


def containerfile_facts(path: Path = CONTAINERFILE) -> ImageFacts:
    steps = instructions(path.read_text())
    base = next(_pairs(args)["BASE"] for keyword, args in steps
                if keyword == "ARG" and args.startswith("BASE="))
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    runtime = steps[last_from:]

    def one(keyword: str) -> str:
        (value,) = [args for k, args in runtime if k == keyword]
        return value

    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    for keyword, args in runtime:
        if keyword == "ENV":
            env.update(_pairs(args))
        elif keyword == "LABEL":
            labels.update(_pairs(args))
    return ImageFacts(base=base, user=one("USER"), exposed=tuple(one("EXPOSE").split()),
                      entrypoint=tuple(json.loads(one("ENTRYPOINT"))), env=env,
                      stop_signal=one("STOPSIGNAL"), labels=labels)


def cpu_quantity(text: str) -> float:
    """A Kubernetes CPU quantity (``"2"``, ``"1500m"``, ``0.5``) in CPUs."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", str(text))
    assert match, f"not a CPU quantity: {text!r}"
    return float(match.group(1)) / (1000 if match.group(2) else 1)
