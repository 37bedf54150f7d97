"""The front page and docs/ hold: README.md stays a front page (at most 10 KB), every relative
link in it and in docs/ points at a file that exists, every `from minillm... import ...` line the
docs show imports, and every `python -m ...` command they name is a module that exists;
docs/api.md stays a reference in chapter sections, small enough to read, naming all of `minillm.__all__`;
every module docstring under minillm/ says what the module is in at most MODULE_DOCSTRING_MAX_LINES."""
import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
IMPORT = re.compile(r"^\s*from (minillm[\w.]*) import \(?([\w, ]+?)\)?\s*(?:#.*)?$", re.M)
COMMAND = re.compile(r"python -m ((?:minillm|benchmarks)[\w.]*)")


def test_readme_is_a_front_page():
    assert (ROOT / "README.md").stat().st_size <= 10_000


API_MD_MAX_BYTES = 27_500   # the aim is ~25 KB; every documented name must still fit


def test_api_md_is_sections_that_name_every_public_name():
    import minillm
    text = (ROOT / "docs" / "api.md").read_text()
    assert len(text.encode()) <= API_MD_MAX_BYTES
    headings = re.findall(r"^## (\d\d) ", text, re.M)
    assert headings == [f"{i:02d}" for i in range(12)], headings   # one section per chapter
    words = set(re.findall(r"\w+", text))
    assert [n for n in minillm.__all__ if n not in words] == []


def test_the_docs_the_readme_promises_exist():
    for name in ("api", "results", "exercises", "sources", "testing"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if "://" not in t and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = [t for t in _links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert broken == [], f"{page.name} links to missing files: {broken}"


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](there.md) [b](https://example.org) [c](#top)")
    assert _links(page) == ["there.md"] and not (tmp_path / "there.md").exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_import_works(page):
    for module, names in IMPORT.findall(page.read_text()):
        mod = importlib.import_module(module)
        for name in (n.strip().split(" as ")[0] for n in names.split(",") if n.strip()):
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), \
                f"{page.name}: from {module} import {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_command_is_a_module(page):
    for module in set(COMMAND.findall(page.read_text())):
        module = module.rstrip(".")
        assert importlib.util.find_spec(module) is not None, f"{page.name}: python -m {module}"


# The aim is about 15 lines (what the module is, its letters, "Left out on purpose"); reasons and
# history go to docs/sources.md. Every docstring under minillm/ is at most this long today.
MODULE_DOCSTRING_MAX_LINES = 20
DOCSTRING_LONG_FOR_NOW: set = set()      # none left


def _docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return len(doc.strip("\n").splitlines()) if doc else 0


def test_module_docstrings_are_short():
    too_long = {name: n for p in sorted((ROOT / "minillm").rglob("*.py"))
                if (name := p.relative_to(ROOT).as_posix()) not in DOCSTRING_LONG_FOR_NOW
                and (n := _docstring_lines(p)) > MODULE_DOCSTRING_MAX_LINES}
    assert not too_long, (f"module docstrings over {MODULE_DOCSTRING_MAX_LINES} lines (move reasons and "
                          f"history to docs/sources.md): {too_long}")


def test_the_docstring_count_can_fail(tmp_path):
    long_doc = tmp_path / "m.py"
    long_doc.write_text('"""' + "line\n" * (MODULE_DOCSTRING_MAX_LINES + 1) + '"""\nx = 1\n')
    assert _docstring_lines(long_doc) == MODULE_DOCSTRING_MAX_LINES + 1


def _long_docstring_lines(path: Path, limit: int = 105) -> list[int]:
    tree = ast.parse(path.read_text())
    if ast.get_docstring(tree, clean=False) is None:
        return []
    lines = path.read_text().splitlines()[:tree.body[0].end_lineno]  # up to the docstring's end
    return [i + 1 for i, line in enumerate(lines) if len(line) > limit]


def test_module_docstring_lines_fit_105_columns(tmp_path):
    too_wide = {p.relative_to(ROOT).as_posix(): rows for p in sorted((ROOT / "minillm").rglob("*.py"))
                if (rows := _long_docstring_lines(p))}
    assert not too_wide, f"module docstring lines over 105 characters: {too_wide}"
    wide = tmp_path / "m.py"
    wide.write_text('"""' + "x" * 106 + '\n"""\n')
    assert _long_docstring_lines(wide) == [1]
