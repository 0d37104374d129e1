"""One map, kept true: every module is named in its room's list and in the layout page, and
every document or file the code cites exists.

Why a test: the maps drifted before (modules missing from the lists, a page cited under a name
it no longer had, "three things" followed by four). A list nobody checks is a list that lies.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import epd_trio

PACKAGE = pathlib.Path(epd_trio.__file__).parent
ROOT = PACKAGE.parent
LAYOUT = ROOT / "docs" / "contributing" / "layout.md"
#: A module list in a docstring: an indented line that starts with the module's name.
LISTED = re.compile(r"^ {4}(\(?[A-Za-z_]\w*\)?)(?: {2,}|$)", re.M)


def rooms() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def listed_names(text: str) -> set[str]:
    return {m.group(1) for m in LISTED.finditer(text)}


def modules_of(room: pathlib.Path) -> set[str]:
    return {p.stem for p in room.glob("*.py") if p.stem != "__init__"}


def test_every_room_lists_exactly_its_modules() -> None:
    for room in rooms():
        if room.name == "testing":
            continue  # public test doubles: listed in the layout page below
        listed = listed_names(docstring(room / "__init__.py"))
        assert listed == modules_of(room), f"{room.name}/__init__ lists {sorted(listed)}"


def test_the_package_comment_names_every_room() -> None:
    names = listed_names(docstring(PACKAGE / "__init__.py"))
    assert {room.name for room in rooms()} <= names, sorted(names)


def layout_bullets(text: str) -> dict[str, set[str]]:
    """The "Every module" section: each bullet's room -> the names in backquotes under it."""
    section = text.split("## Every module", 1)[1].split("\n## ", 1)[0]
    found: dict[str, set[str]] = {}
    for bullet in re.split(r"\n- ", "\n" + section.strip()):
        head = re.match(r"\*\*`?([\w ]+?)/?`?\*\*", bullet.strip())
        if head:
            found[head.group(1)] = set(re.findall(r"`([\w.]+)`", bullet))
    return found


def test_the_layout_page_names_every_module() -> None:
    bullets = layout_bullets(LAYOUT.read_text())
    for room in rooms():
        assert room.name in bullets, f"no bullet for {room.name}/ in {LAYOUT.name}"
        missing = modules_of(room) - bullets[room.name]
        assert not missing, f"{LAYOUT.name} does not name {room.name}/{sorted(missing)}"
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert not top - bullets["Top level"], sorted(top - bullets["Top level"])


def test_the_layout_check_can_fail() -> None:
    page = "## Every module\n\n- **`_x/`**: `a` (one), `b`.\n- **Top level**: `_proxy`.\n## Next\n"
    assert layout_bullets(page) == {"_x": {"a", "b"}, "Top level": {"_proxy"}}


CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")


def cited_documents(text: str) -> set[str]:
    return set(CITED.findall(text))


def prose_of(source: str) -> str:
    """The comments and docstrings of a module: where a citation is prose. (A path the code
    builds, ``DOCS / "how-to" / page``, is checked by running that code.)"""
    parts = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


def test_every_document_the_code_cites_exists() -> None:
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").rglob("*.py"),
               *(ROOT / "deploy").rglob("*.py")]
    missing = []
    for path in sources:
        for cited in cited_documents(prose_of(path.read_text())):
            if not any((base / cited).exists() for base in (ROOT, path.parent, ROOT / "docs")):
                missing.append(f"{path.relative_to(ROOT)} cites {cited}")
    assert missing == []


def test_the_citation_check_can_fail() -> None:
    assert cited_documents("see PROTOCOL.md and docs/how-to/routing.md, not x.mdx") == {
        "PROTOCOL.md", "docs/how-to/routing.md"}
    source = '"""Docs: a.md."""\nPAGE = ROOT / "b.md"  # c.md\n'
    assert cited_documents(prose_of(source)) == {"a.md", "c.md"}
