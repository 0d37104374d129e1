"""The ``_kv`` package's rule (its ``__init__`` docstring), enforced: the pure modules do no I/O."""

from __future__ import annotations

import pathlib

from test_layout import room_breaks, room_violations

import epd_trio._kv

KV = pathlib.Path(epd_trio._kv.__file__).parent
PURE = {"wire", "keys", "index", "feed", "prompt"}
SHELL = {"subscriber"}
#: Third-party modules each kind may import besides the standard library.
PURE_THIRD_PARTY = {"msgpack"}
SHELL_THIRD_PARTY = {"msgpack", "trio", "zmq"}


def violations(path: pathlib.Path, *, pure: bool) -> list[str]:
    """What ``path`` imports against the rule (empty: none)."""
    return room_violations(path, room="_kv", pure=pure, pure_modules=PURE,
                           pure_third_party=PURE_THIRD_PARTY, shell_third_party=SHELL_THIRD_PARTY)


def test_every_kv_module_is_pure_or_shell_and_keeps_to_its_imports() -> None:
    assert set(PURE | SHELL) <= {p.stem for p in KV.glob("*.py")}
    assert room_breaks(KV, PURE, SHELL, violations) == {}


def test_the_kv_rule_catches_violations(tmp_path: pathlib.Path) -> None:
    """The check above can fail: I/O and shell imports in a pure module are each seen."""
    bad = tmp_path / "bad.py"
    bad.write_text("import trio\nimport socket\nimport msgpack\nfrom .subscriber import KvEvents\n"
                   "from .._http import Pool\nfrom .._core.errors import BadRequest\n"
                   "from .wire import decode_batch\nimport epd_trio.app\n")
    assert set(violations(bad, pure=True)) == {
        "reaches outside _kv and _core (from .._http)",
        "imports the sibling 'subscriber', which is not pure",
        "imports epd_trio absolutely (use .._core)",
        "imports socket",
        "imports trio",
    }
    assert set(violations(bad, pure=False)) == {
        "reaches outside _kv and _core (from .._http)",
        "imports epd_trio absolutely (use .._core)",
    }
