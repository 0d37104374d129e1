"""The ``_kv`` package's rule (its ``__init__`` docstring), enforced: the pure modules do no I/O."""

from __future__ import annotations

import pathlib
import sys

from test_layout import imported_modules

import epd_trio._kv

KV = pathlib.Path(epd_trio._kv.__file__).parent
PURE = {"wire", "keys", "index", "feed", "prompt"}
SHELL = {"subscriber"}
#: Third-party modules each kind may import besides the standard library.
PURE_THIRD_PARTY = {"msgpack"}
SHELL_THIRD_PARTY = {"msgpack", "trio", "zmq"}
#: Standard-library modules that are I/O, refused in pure modules.
PURE_FORBIDDEN_STDLIB = {"socket", "asyncio", "selectors", "threading", "subprocess", "ssl"}


def violations(path: pathlib.Path, *, pure: bool) -> list[str]:
    """What ``path`` imports against the rule (empty: none)."""
    found = []
    allowed = PURE_THIRD_PARTY if pure else SHELL_THIRD_PARTY
    for name, level in sorted(imported_modules(path)):
        if level == 1:
            if pure and name not in PURE:
                found.append(f"imports the sibling {name!r}, which is not pure")
        elif level == 2:
            if name != "_core":
                found.append(f"reaches outside _kv and _core (from ..{name})")
        elif level > 2:
            found.append(f"reaches outside the package (from {'.' * level}{name})")
        elif name == "epd_trio":
            found.append("imports epd_trio absolutely (use .._core)")
        elif name in sys.stdlib_module_names or name == "__future__":
            if pure and name in PURE_FORBIDDEN_STDLIB:
                found.append(f"imports {name}")
        elif name not in allowed:
            found.append(f"imports {name}")
    return found


def test_every_kv_module_is_pure_or_shell_and_keeps_to_its_imports() -> None:
    modules = {path.stem: path for path in KV.glob("*.py") if path.stem != "__init__"}
    assert set(modules) == PURE | SHELL, "classify a new _kv module as pure or shell here"
    for name, path in sorted(modules.items()):
        assert violations(path, pure=name in PURE) == [], f"_kv/{name}.py"
    assert imported_modules(KV / "__init__.py") <= {("__future__", 0)}


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
