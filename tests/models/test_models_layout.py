"""The ``_models`` package's rule (its ``__init__`` docstring), enforced: the pure modules do no
I/O, and only the shells (the learner, the adapter loader) import trio."""

from __future__ import annotations

import pathlib

from test_layout import room_breaks, room_violations

import epd_trio._models

MODELS = pathlib.Path(epd_trio._models.__file__).parent
PURE = {"cards", "tables", "pools", "choice", "catalog"}
SHELL = {"learner", "loading"}


def violations(path: pathlib.Path, *, pure: bool) -> list[str]:
    return room_violations(path, room="_models", pure=pure, pure_modules=PURE,
                           pure_third_party={"orjson"}, shell_third_party={"orjson", "trio"})


def test_every_models_module_is_pure_or_shell_and_keeps_to_its_imports() -> None:
    assert set(PURE | SHELL) <= {p.stem for p in MODELS.glob("*.py")}
    assert room_breaks(MODELS, PURE, SHELL, violations) == {}


def test_the_models_rule_catches_violations(tmp_path: pathlib.Path) -> None:
    """The check above can fail: trio, the shell, and a room beyond _core are each seen."""
    bad = tmp_path / "bad.py"
    bad.write_text("import trio\nfrom .learner import ModelLearner\nfrom .._state import loads\n"
                   "from .._core.roster import Card\nfrom .pools import Pool\n")
    assert set(violations(bad, pure=True)) == {
        "imports trio", "imports the sibling 'learner', which is not pure",
        "reaches outside _models and _core (from .._state)"}
    assert violations(bad, pure=False) == ["reaches outside _models and _core (from .._state)"]
