"""The package's shape is a contract: a few concept folders, a core that never imports plotting or
benchmarks, `import minillm` that stays light, and the flat module paths of earlier versions
still importable (course labs use them) as the very same module objects."""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import minillm
from minillm._compat import OLD_PATHS

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
        bad = {n for n in _imports(path) if n.startswith(("minillm.viz", "minillm.lab", "matplotlib"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_import_minillm_loads_no_plotting_or_benchmark_code():
    code = ("import sys, minillm; bad = [m for m in sys.modules if m.startswith("
            "('matplotlib', 'minillm.viz', 'minillm.lab', 'ipywidgets'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_flat_paths_are_the_new_modules(old):
    new = importlib.import_module(f"minillm.{OLD_PATHS[old]}")
    assert importlib.import_module(f"minillm.{old}") is new
    assert (PKG / f"{old}.py").exists() is False                    # an alias, not a copy


def test_the_functions_keep_their_names_after_the_old_modules_are_imported():
    importlib.import_module("minillm.generate")
    importlib.import_module("minillm.chat")
    from minillm.generate import generate_batch                     # noqa: F401  (old labs)
    assert callable(minillm.generate) and minillm.generate.__name__ == "generate"
    assert callable(minillm.chat) and minillm.chat.__name__ == "chat"
    assert minillm.spec_theory is importlib.import_module("minillm.analysis.spec_theory")


def test_python_dash_m_works_on_an_old_path():
    out = subprocess.run([sys.executable, "-m", "minillm.cpu_tuning", "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--retune" in out.stdout, out.stderr[-500:]


def test_the_front_door_names_import_from_minillm():
    for name in minillm.__all__:
        assert getattr(minillm, name) is not None
    assert {"LLM", "SamplingParams", "EngineConfig", "LLMEngine", "load_model",
            "tiny_model", "generate", "RequestOutput", "CompletionOutput"} <= set(minillm.__all__)
