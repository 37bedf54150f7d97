"""Every import goes down: no cycle between the package's files, counting imports placed inside
functions (a lazy import is a cycle hidden from the reader), and no folder that imports a folder
on a higher floor. `import minillm` installs no import hook.

The graph is read with `ast` from the source, so nothing is imported to draw it.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The floors, from the ground up. A module may import its own folder and any lower floor.
FLOORS = [
    {"_validate", "_paths"},
    {"model"},
    {"analysis", "kernels"},
    {"attention"},
    {"paging"},
    {"spec", "quant"},
    {"engine"},
    {"distributed"},
    {"drafting"},
    {"llm"},
    {"__init__", "viz"},
    {"serve"},
    {"lab"},
    {"exercises", "__main__"},
]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree):
    """Import nodes anywhere in the file (inside functions too), skipping `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, for every .py file under root/package. A
    package's __init__ importing its own children is not an edge (that is what __init__ is)."""
    mods = {module_name(root, p): p for p in (root / package).rglob("*.py")}
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in _imports(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not (is_pkg and t.startswith(m + ".")) \
                        and not m.startswith(t + "."):
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(module: str) -> int:
    """The floor of a module's folder (an unplaced folder counts as the top: the test above
    names it)."""
    folder = _folder(module)
    return next((i for i, floor in enumerate(FLOORS) if folder in floor), len(FLOORS))


def test_no_import_cycle_between_files():
    found = cycles(import_graph(ROOT, "minillm"))
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_folder_is_on_a_floor():
    folders = {_folder(m) for m in import_graph(ROOT, "minillm")}
    placed = set().union(*FLOORS)
    assert folders <= placed, f"folders with no floor: {sorted(folders - placed)}"


def test_every_import_goes_down():
    up = sorted(f"{m} -> {t}" for m, ts in import_graph(ROOT, "minillm").items() for t in ts
                if _floor(t) > _floor(m))
    assert up == [], "imports of a higher floor:\n" + "\n".join(up)


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    """The checks above can fail: a lazy import that closes a loop is found, and so is an
    upward one."""
    pkg = tmp_path / "toy"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from toy.low import a\n")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("import toy.high\n")
    (pkg / "high.py").write_text("def f():\n    from toy.low.a import x\n")
    (pkg / "alone.py").write_text("from .low import a\n")
    edges = import_graph(tmp_path, "toy")
    assert cycles(edges) == [["toy.high", "toy.low.a"]]
    assert edges["toy.alone"] == {"toy.low", "toy.low.a"}
    assert edges["toy"] == set()                        # __init__ importing its children


def test_import_minillm_installs_no_import_hook():
    code = ("import sys, types; before = list(sys.meta_path), list(sys.path_hooks); import minillm; "
            "print(list(sys.meta_path) == before[0] and list(sys.path_hooks) == before[1], "
            "type(minillm) is types.ModuleType)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("old", ["minillm.roofline", "minillm.cpu_tuning", "minillm.paging_viz"])
def test_old_flat_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        __import__(old)
