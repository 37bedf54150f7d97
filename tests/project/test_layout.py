"""The package's shape is a contract: a few concept folders, a core that never imports plotting or
benchmarks, and `import minillm` that stays light. (Which folder may import which:
test_imports.py.)"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import minillm

PKG = Path(minillm.__file__).parent
CORE = ("model", "paging", "engine", "spec")


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", CORE)
def test_the_core_imports_no_plotting_and_no_benchmarks(folder):
    for path in (PKG / folder).glob("*.py"):
        bad = {n for n in _imports(path)
               if n.startswith(("minillm.viz", "minillm.lab", "benchmarks", "matplotlib"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_import_minillm_loads_no_plotting_or_benchmark_code():
    code = ("import sys, minillm; bad = [m for m in sys.modules if m.startswith("
            "('matplotlib', 'minillm.viz', 'minillm.lab', 'benchmarks', 'ipywidgets'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_front_door_names_import_from_minillm():
    for name in minillm.__all__:
        assert getattr(minillm, name) is not None
    assert {"LLM", "SamplingParams", "EngineConfig", "LLMEngine", "load_model",
            "tiny_model", "generate", "RequestOutput", "CompletionOutput"} <= set(minillm.__all__)


def test_layout_md_sizes_match_the_tree():
    from layout_sizes import LAYOUT, sizes, stale
    wrong = stale(LAYOUT.read_text(), sizes())
    assert not wrong, ("docs/layout.md's sizes have drifted; run `python tests/layout_sizes.py "
                       "--write` and commit docs/layout.md:\n" + "\n".join(wrong))


def test_the_layout_size_check_can_fail():
    from layout_sizes import LAYOUT, rewrite, sizes, stale
    counted = sizes()
    text = rewrite(LAYOUT.read_text(), counted)
    assert stale(text, counted) == []
    moved = {**counted, "engine/": (counted["engine/"][0] + 1, counted["engine/"][1])}
    assert stale(text, moved) == [f"engine/: says {counted['engine/'][0]} files, "
                                  f"{round(counted['engine/'][1], -2)} lines; counted "
                                  f"{moved['engine/'][0]}, {moved['engine/'][1]}"]
    grown = {**counted, "benchmarks/": (counted["benchmarks/"][0], counted["benchmarks/"][1] + 160)}
    assert [w.split(":")[0] for w in stale(text, grown)] == ["benchmarks/"]
    assert stale(text, {**counted, "new/": (1, 10)}) == ["new/: no row in docs/layout.md"]
