"""The layering the package's ``__init__`` describes, enforced: the pure core imports no I/O,
each sub-package imports only the rooms its rule names, and no import runs in a circle."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable

import epd_trio._core

CORE = pathlib.Path(epd_trio._core.__file__).parent
#: What the core may import besides the standard library and its siblings.
ALLOWED_THIRD_PARTY = {"orjson", "msgpack"}
FORBIDDEN = {"trio", "httpcore", "httpcore2", "httpx", "httpx2", "quart", "quart_trio",
             "hypercorn", "prometheus_client", "socket", "asyncio", "urllib3"}


def imported_modules(path: pathlib.Path) -> set[tuple[str, int]]:
    """Top-level module names imported by a file (relative imports as level > 0)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], 0) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(((node.module or "").split(".")[0], node.level))
    return found


#: Pure modules outside ``_core``: logic whose one user is a shell module sits beside it in
#: that module's room (``_core`` does not grow with what one room alone uses), held to the
#: core's rule all the same. They may import the standard library, ``_core`` and nothing else.
PURE_OUTSIDE_CORE = ("_serve/cpu_quota.py",)


def impure_imports(path: pathlib.Path, *, in_core: bool) -> list[str]:
    """What a pure module imports beyond the core's rule: an I/O library, a third-party package
    the core does not allow, or (outside ``_core``) any module of the package but ``_core``'s.
    Inside ``_core`` a sibling is fine (``from .names``), nothing above it is."""
    found = []
    for name, level in sorted(imported_modules(path)):
        if in_core and level == 1:
            continue  # a sibling in _core
        if level == 1 or (level == 2 and name != "_core") or level > 2 or (in_core and level):
            found.append(f"{path.name} imports {'.' * level}{name}, outside what a pure module "
                         "may import (the standard library and _core)")
        elif level == 0 and (name in FORBIDDEN or not (
                name == "__future__" or name in ALLOWED_THIRD_PARTY or _is_stdlib(name))):
            found.append(f"{path.name} imports {name}, which is neither the standard library nor "
                         f"one of {sorted(ALLOWED_THIRD_PARTY)}")
    return found


def test_the_core_imports_no_io_library() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        assert impure_imports(path, in_core=True) == [], f"_core/{path.name}"


def test_the_pure_modules_outside_the_core_keep_its_rule() -> None:
    for name in PURE_OUTSIDE_CORE:
        path = CORE.parent / name
        assert path.is_file(), f"{name} is listed as pure but does not exist"
        assert impure_imports(path, in_core=False) == [], name


def _is_stdlib(name: str) -> bool:
    import sys
    return name in sys.stdlib_module_names


#: Standard-library modules that are I/O, refused in a room's pure modules.
PURE_FORBIDDEN_STDLIB = {"socket", "asyncio", "selectors", "threading", "subprocess", "ssl"}


def room_violations(path: pathlib.Path, *, room: str, pure: bool, pure_modules: set[str],
                    pure_third_party: set[str], shell_third_party: set[str]) -> list[str]:
    """What ``path``, a module of ``room`` (``_kv``, ``_models``: pure modules beside one
    shell), imports against the room's rule (empty: none): a pure module imports only its
    pure siblings, ``_core``, the standard library without I/O and ``pure_third_party``; the
    shell may add ``shell_third_party``."""
    found = []
    allowed = pure_third_party if pure else shell_third_party
    for name, level in sorted(imported_modules(path)):
        if level == 1:
            if pure and name not in pure_modules:
                found.append(f"imports the sibling {name!r}, which is not pure")
        elif level == 2:
            if name != "_core":
                found.append(f"reaches outside {room} and _core (from ..{name})")
        elif level > 2:
            found.append(f"reaches outside the package (from {'.' * level}{name})")
        elif name == "epd_trio":
            found.append("imports epd_trio absolutely (use .._core)")
        elif name in _stdlib() or name == "__future__":
            if pure and name in PURE_FORBIDDEN_STDLIB:
                found.append(f"imports {name}")
        elif name not in allowed:
            found.append(f"imports {name}")
    return found


def room_breaks(folder: pathlib.Path, pure: set[str], shell: set[str],
                violations: Callable[..., list[str]]) -> dict[str, list[str]]:
    """Every module of a room of pure modules beside a shell (``folder``) against its rule:
    ``{module: what it breaks}`` for those that break it, a module of neither set included,
    and the room's ``__init__`` importing anything (so a pure module loads no shell)."""
    modules = {path.stem: path for path in folder.glob("*.py") if path.stem != "__init__"}
    found = {name: ["classify it as pure or shell in its room's layout test"]
             for name in modules if name not in pure | shell}
    found |= {name: broken for name, path in sorted(modules.items())
              if (broken := violations(path, pure=name in pure))}
    if not imported_modules(folder / "__init__.py") <= {("__future__", 0)}:
        found["__init__"] = ["imports something"]
    return found


def _stdlib() -> frozenset[str]:
    import sys
    return sys.stdlib_module_names


def test_the_import_rule_catches_a_violation(tmp_path: pathlib.Path) -> None:
    """The checks above can fail: an import of trio, of a third-party package, of the shell, or
    (outside the core) of a sibling is named; the standard library and the core are not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import trio\nfrom .._http import UpstreamPool\nfrom .names import STAGES\n")
    assert imported_modules(bad) == {("trio", 0), ("_http", 2), ("names", 1)}
    assert [line.split(",")[0] for line in impure_imports(bad, in_core=True)] == [
        "bad.py imports .._http", "bad.py imports trio"]
    beside = tmp_path / "beside.py"
    beside.write_text("import os\nimport yaml\nfrom .._core.names import STAGES\n"
                      "from .process import read_cpu_limit\n")
    assert [line.split(",")[0] for line in impure_imports(beside, in_core=False)] == [
        "beside.py imports .process", "beside.py imports yaml"]
    (tmp_path / "clean.py").write_text("from __future__ import annotations\nimport math\n"
                                       "from .._core import names\n")
    assert impure_imports(tmp_path / "clean.py", in_core=False) == []


def import_graph(package: pathlib.Path, *, type_only: bool = False) -> dict[str, set[str]]:
    """Each module of ``package`` (a directory) -> the package's own modules it imports.

    Every import statement counts, wherever it sits: a function-local import hides a cycle
    rather than breaking it (the loop is still there, it only fails later, at the first call).
    Only imports under ``if TYPE_CHECKING:`` are left out: they never run (``type_only``:
    count them too, since a type-only circle still says one module should not know the
    other). ``from .x import y`` points at ``x.y`` when that is a module, else at ``x``;
    relative and absolute forms alike.
    """
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        type_only_nodes = {id(node) for guard in ast.walk(tree)
                     if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
                     for statement in guard.body for node in ast.walk(statement)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in type_only_nodes and not type_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join([*here[: len(here) - node.level + 1], *module.split(".")])
                    module = module.strip(".")
                # ``from p import m`` needs only the module ``m`` when it is one, not p's body.
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in files
                           else module for alias in node.names]
            else:
                continue
            deps |= {t for t in map(resolve, targets) if t is not None and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None: a depth-first walk over ``graph``."""
    done: set[str] = set()
    path: list[str] = []

    def walk(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name):], name]
        if name in done:
            return None
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if (cycle := walk(dep)) is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if (cycle := walk(name)) is not None:
            return cycle
    return None


def test_no_import_cycles_anywhere_in_the_package() -> None:
    """The package rule: no module cycles, of any length, in any subpackage (testing/ too)."""
    graph = import_graph(CORE.parent)
    assert "epd_trio.testing.cluster" in graph and len(graph) >= 40
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_even_through_type_only_imports() -> None:
    """Not even a type-only circle: ``_handoff`` names what it needs of a request run as a
    protocol, instead of importing the pipeline that imports it."""
    cycle = find_cycle(import_graph(CORE.parent, type_only=True))
    assert cycle is None, "type-only import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_rule_catches_a_long_cycle_through_a_local_import(
    tmp_path: pathlib.Path,
) -> None:
    """The check above can fail: a three-module loop closed by an import inside a function is
    found; an import under TYPE_CHECKING is not counted."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .a import A as A\n")
    (package / "sub" / "a.py").write_text("from .b import B\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nfrom pkg.sub import c\n"
        "if TYPE_CHECKING:\n    from . import a\n")
    (package / "sub" / "c.py").write_text("def make():\n    from .a import A\n    return A\n")
    graph = import_graph(package)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}  # the TYPE_CHECKING one left out
    assert import_graph(package, type_only=True)["pkg.sub.b"] == {"pkg.sub.c", "pkg.sub.a"}
    assert graph["pkg.sub"] == {"pkg.sub.a"}
    assert find_cycle(graph) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.a"]
    (package / "sub" / "c.py").write_text("def make():\n    return 1\n")
    assert find_cycle(import_graph(package)) is None


PACKAGE = CORE.parent
#: Each sub-package's rule (its ``__init__`` says it in prose): the package's own modules may
#: import, inside epd_trio, only these. A top-level name (``_proxy``, ``_app``...) stands for
#: that module. ``testing`` is the test doubles, which may use anything.
IMPORT_RULES: dict[str, set[str]] = {
    "_core": set(),
    "_state": {"_core"},
    "_observe": {"_core"},
    "_discovery": {"_core"},
    "_admission": {"_core"},
    "_kv": {"_core"},
    "_models": {"_core"},
    "_upstream": {"_core", "_state"},
    "_replicas": {"_core", "_state", "_observe"},
    "_membership": {"_core", "_state", "_upstream", "_observe", "_discovery", "_replicas",
                    "_models"},
    "_web": {"_core", "_admission", "_observe", "_proxy", "_pipeline"},
    "_serve": {"_core", "_state", "_observe", "_web", "_replicas", "_app", "_environment"},
}


def room_of(module: str) -> str:
    """``epd_trio._upstream.legs`` -> ``_upstream``; ``epd_trio._proxy`` -> ``_proxy``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def rule_breaks(graph: dict[str, set[str]], rules: dict[str, set[str]]) -> list[str]:
    """Every import from a ruled package to a room its rule does not name."""
    found = []
    for module, deps in sorted(graph.items()):
        room = room_of(module)
        if room not in rules:
            continue
        for dep in sorted(deps):
            target = room_of(dep)
            if target and target != room and target not in rules[room]:
                found.append(f"{module} imports {dep}")
    return found


def test_every_sub_package_has_a_rule_and_keeps_it() -> None:
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms - {"testing"} == set(IMPORT_RULES), "a package without a rule, or a rule without one"
    assert rule_breaks(import_graph(PACKAGE), IMPORT_RULES) == []


def test_the_package_rule_catches_an_import_upward() -> None:
    """The check above can fail: an upstream module importing the owner is named."""
    graph = {"epd_trio._upstream.legs": {"epd_trio._proxy", "epd_trio._state.loads"},
             "epd_trio._proxy": {"epd_trio._upstream.legs"}}
    assert rule_breaks(graph, IMPORT_RULES) == ["epd_trio._upstream.legs imports epd_trio._proxy"]


def test_the_top_level_keeps_the_owner_the_pipeline_and_the_public_modules() -> None:
    """Sub-packages are the rooms; the top level is the hall: about a dozen files."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def test_the_composition_root_is_made_of_small_pieces() -> None:
    """``_app`` wires, in functions that each say what they wire: none over 80 lines (its
    ``create_app`` once held 193, every route and hook of the app inline)."""
    tree = ast.parse((PACKAGE / "_app.py").read_text())
    lengths = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
               and node.end_lineno is not None}
    assert "create_app" in lengths and len(lengths) >= 10
    assert {name: n for name, n in lengths.items() if n > 80} == {}
