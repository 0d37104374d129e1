"""The layering the package's ``__init__`` describes, enforced: the pure core imports no I/O."""

from __future__ import annotations

import ast
import pathlib

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


def test_the_core_imports_no_io_library() -> None:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        for name, level in imported_modules(path):
            if level > 1:
                raise AssertionError(f"{path.name} reaches outside _core (from {'.' * level}{name})")
            if level == 1:
                continue  # a sibling in _core
            assert name not in FORBIDDEN, f"_core/{path.name} imports {name}"
            assert name == "__future__" or name in ALLOWED_THIRD_PARTY or _is_stdlib(name), (
                f"_core/{path.name} imports {name}, which is neither the standard library nor "
                f"one of {sorted(ALLOWED_THIRD_PARTY)}")


def _is_stdlib(name: str) -> bool:
    import sys
    return name in sys.stdlib_module_names


def test_the_import_rule_catches_a_violation(tmp_path: pathlib.Path) -> None:
    """The check above can fail: an import of trio or of the shell is seen."""
    bad = tmp_path / "bad.py"
    bad.write_text("import trio\nfrom .._http import UpstreamPool\nfrom .names import STAGES\n")
    assert imported_modules(bad) == {("trio", 0), ("_http", 2), ("names", 1)}


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    """No import cycles among the package's own modules (module level, not TYPE_CHECKING)."""
    package = CORE.parent
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        deps = set()
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module-level only: a function-local import breaks a cycle
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = base[: len(base) - node.level + 1] + (node.module or "").split(".")
                deps.add(".".join(p for p in parts if p))
        graph[name] = deps
    modules = set(graph)

    def resolve(dep: str) -> str | None:
        while dep and dep not in modules:
            dep = dep.rpartition(".")[0]
        return dep or None

    for name, deps in graph.items():
        for dep in deps:
            target = resolve(dep)
            if target is None or target == name or target == "epd_trio":
                continue
            back = {resolve(d) for d in graph.get(target, ())}
            assert name not in back, f"{name} and {target} import each other"
