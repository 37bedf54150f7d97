"""The sizes docs/layout.md prints, counted from the tree: files and lines of Python per folder.

    python tests/layout_sizes.py           # prints the counts
    python tests/layout_sizes.py --write   # rewrites the numbers in docs/layout.md

Lines are written rounded to the nearest hundred, so an ordinary commit does not move them;
`stale` (tests/project/test_layout.py) reports a row whose written count is off by more than `SLACK`
lines, or whose file count differs at all.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
TOP_LEVEL = "top level"      # the package's top-level files other than llm.py
SLACK = 100                  # a written line count may be this far from today's
ROW = re.compile(r"^\| `?([\w./]+)`? \|(.*)\| ([\d,]+) \| ([\d,]+) \|$", re.M)
ROW_TOP = re.compile(r"^\| (top level) \|(.*)\| ([\d,]+) \| ([\d,]+) \|$", re.M)
BENCH = re.compile(r"`benchmarks/` \(([\d,]+) files, ([\d,]+) lines\)")


def _count(paths: list[Path]) -> tuple[int, int]:
    return len(paths), sum(len(p.read_text().splitlines()) for p in paths)


def sizes(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """{row: (files, lines)} for each folder of minillm/, llm.py, the top level and benchmarks/."""
    pkg = root / "minillm"
    out = {f"{d.name}/": _count(sorted(d.rglob("*.py")))
           for d in sorted(pkg.iterdir()) if d.is_dir() and d.name != "__pycache__"}
    out["llm.py"] = _count([pkg / "llm.py"])
    out[TOP_LEVEL] = _count([p for p in sorted(pkg.glob("*.py")) if p.name != "llm.py"])
    out["benchmarks/"] = _count(sorted((root / "benchmarks").rglob("*.py")))
    return out


def _num(text: str) -> int:
    return int(text.replace(",", ""))


def _rounded(lines: int) -> str:
    return f"{max(100, round(lines, -2)):,}"


def written(text: str) -> dict[str, tuple[int, int]]:
    """The (files, lines) docs/layout.md states for each row."""
    out = {m[1]: (_num(m[3]), _num(m[4])) for m in ROW.finditer(text)}
    out.update({m[1]: (_num(m[3]), _num(m[4])) for m in ROW_TOP.finditer(text)})
    out.update({"benchmarks/": (_num(m[1]), _num(m[2])) for m in BENCH.finditer(text)})
    return out


def stale(text: str, counted: dict[str, tuple[int, int]]) -> list[str]:
    """Each disagreement between the doc and the tree, in words; [] when the doc holds."""
    said = written(text)
    wrong = [f"{row}: no row in docs/layout.md" for row in counted if row not in said]
    wrong += [f"{row}: a row for nothing in the tree" for row in said if row not in counted]
    for row in said.keys() & counted.keys():
        (files, lines), (n_files, n_lines) = said[row], counted[row]
        if files != n_files or abs(lines - n_lines) > SLACK:
            wrong.append(f"{row}: says {files} files, {lines} lines; counted {n_files}, {n_lines}")
    return sorted(wrong)


def rewrite(text: str, counted: dict[str, tuple[int, int]]) -> str:
    """The doc with every row's numbers replaced by today's counts (lines rounded)."""
    def row(m):
        files, lines = counted[m[1]]
        return m[0][:m.start(3) - m.start(0)] + f"{files} | {_rounded(lines)} |"
    text = ROW_TOP.sub(row, ROW.sub(row, text))
    files, lines = counted["benchmarks/"]
    return BENCH.sub(f"`benchmarks/` ({files} files, {_rounded(lines)} lines)", text)


if __name__ == "__main__":
    counted = sizes()
    if sys.argv[1:] == ["--write"]:
        LAYOUT.write_text(rewrite(LAYOUT.read_text(), counted))
    for row, (files, lines) in counted.items():
        print(f"{row:14} {files:3} files {lines:6,} lines")
