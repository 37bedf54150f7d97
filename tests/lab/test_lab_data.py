"""Records, the recorded schedule and figures are found through the package, never through the
current directory; no module of the package writes or imports the benchmarks.

minillm.lab reads the committed records of the checkout that holds the package (or
$MINILLM_RESULTS_DIR) and ships the recorded n-gram schedule as package data; the top-level
benchmarks package writes records beside itself. An installed package, with no checkout around
it, has no records: load_results says so and returns none."""
import ast
import json
from pathlib import Path

import pytest

import minillm
from minillm.lab import common
from minillm.lab.spec_replay import schedule_file
from minillm import _paths

PACKAGE = Path(minillm.__file__).resolve().parent
CHECKOUT = PACKAGE.parent


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from a folder that is no project, with no results folder named in the environment."""
    monkeypatch.delenv(common.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_committed_records_are_found_from_the_package_not_the_current_directory(elsewhere):
    assert common.results_dir() == CHECKOUT / "benchmarks" / "results"
    names = {r["benchmark"] for r in common.load_results()}
    assert {"decode", "spec", "serving"} <= names
    assert [r["benchmark"] for r in common.load_results("spec")] == ["spec"]


def test_results_env_var_is_read_and_a_relative_one_is_taken_from_the_checkout(elsewhere, monkeypatch):
    (elsewhere / "mine").mkdir()
    (elsewhere / "mine" / "x_cpu.json").write_text(json.dumps({"benchmark": "x", "machine": {}}))
    monkeypatch.setenv(common.RESULTS_ENV, str(elsewhere / "mine"))
    assert [r["benchmark"] for r in common.load_results()] == ["x"]
    monkeypatch.setenv(common.RESULTS_ENV, "benchmarks/results")
    assert common.results_dir() == CHECKOUT / "benchmarks" / "results"


def test_an_installed_package_has_no_records_and_says_so(elsewhere, monkeypatch):
    site = elsewhere / "site-packages"
    (site / "minillm").mkdir(parents=True)                     # no pyproject.toml above it
    monkeypatch.setattr(_paths, "PACKAGE_DIR", site / "minillm")
    assert _paths.checkout_root() is None and common.results_dir() is None
    with pytest.warns(UserWarning, match="not a source checkout.*MINILLM_RESULTS_DIR"):
        assert common.load_results("spec") == []
    monkeypatch.setenv(common.RESULTS_ENV, str(elsewhere / "missing"))
    with pytest.warns(UserWarning, match="is not a folder"):
        assert common.load_results() == []


def test_the_recorded_schedule_is_package_data(elsewhere):
    path = schedule_file()
    assert path.parent == PACKAGE / "lab" and path.is_file()
    data = json.loads(path.read_text())
    assert set(data["prompts"]) == {"summarize", "rewrite", "extract", "code_edit"}
    assert all(p["prompt"] and p["output"] for p in data["prompts"].values())


def test_benchmark_records_and_the_tokenizer_folder_sit_beside_the_benchmarks(elsewhere, monkeypatch):
    from benchmarks import gpu_model, records
    assert records.results_dir() == CHECKOUT / "benchmarks" / "results"
    assert gpu_model.tokenizer_dir() == CHECKOUT / "build" / "smollm2_tokenizer"
    monkeypatch.setenv(common.RESULTS_ENV, str(elsewhere / "out"))
    path = records.write_result("unit", {"x": 1}, "cpu")
    assert path == elsewhere / "out" / "unit_cpu.json"
    assert json.loads(path.read_text())["machine"]["device"] == "cpu"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_package_module_imports_the_benchmarks():
    """The wheel ships minillm/ alone: a module importing `benchmarks` (even inside a function)
    would fail there, and would let the package write records."""
    bad = {str(p.relative_to(CHECKOUT)): sorted(n for n in _imports(p) if n.split(".")[0] == "benchmarks")
           for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}
