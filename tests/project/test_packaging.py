"""minillm installs as a package: a wheel and an sdist built from the tree carry every subpackage
and every data file, and the installed wheel runs the engine in an interpreter that cannot see
this checkout (no editable finder, no PYTHONPATH, started in an empty folder).

The build runs offline with the setuptools of the dev environment (`--no-build-isolation`), on a
copy of the tree, so the checkout gets no build/ or *.egg-info folder.
"""
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "minillm"
_IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "__pycache__", "*.egg-info", "notebooks",
                                 ".hypothesis", ".ipynb_checkpoints")


def _package_files() -> set[str]:
    """What the package is made of: every .py under minillm/ and every data file beside them."""
    return {p.relative_to(ROOT).as_posix() for p in PKG.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel, sdist) built from a copy of the tree."""
    tmp = tmp_path_factory.mktemp("pkg")
    src, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_IGNORE)
    for hook in ("build_wheel", "build_sdist"):            # one process each, as pip does
        code = f"import sys; from setuptools import build_meta as b; b.{hook}(sys.argv[1])"
        run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr[-3000:]
    return next(out.glob("minillm-*.whl")), next(out.glob("minillm-*.tar.gz"))


@pytest.mark.slow
def test_the_wheel_carries_every_module_and_data_file(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        inside = {n for n in z.namelist() if n.startswith("minillm/")}
    missing = _package_files() - inside
    assert not missing, f"the wheel lacks {sorted(missing)[:10]}"
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in z.namelist())


@pytest.mark.slow
def test_the_sdist_carries_every_module_and_data_file(built):
    _, sdist = built
    with tarfile.open(sdist) as t:
        inside = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    missing = _package_files() - inside
    assert not missing, f"the sdist lacks {sorted(missing)[:10]}"


# Run in the clean interpreter: the installed wheel first on the path, then this environment's
# site-packages for torch and the other dependencies, read without their .pth files (-S), so the
# editable install's finder never loads.
_CLEAN = """
import json, sys
sys.path[:0] = [sys.argv[1]]
sys.path.append(sys.argv[2])
blocked = set(sys.argv[3].split(",")) - {""}
class Missing:                                   # an environment without the optional extras
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
import minillm
from minillm import LLM, SamplingParams, tiny_model
outs = LLM(tiny_model(vocab_size=64)).generate([[1, 2, 3]], SamplingParams(max_tokens=4))
from minillm.kernels.route_priors import load_priors        # package data: the untimed route guesses
report = {"file": minillm.__file__, "tokens": outs[0].outputs[0].token_ids, "errors": {},
          "priors": len(load_priors())}
for name in sys.argv[4].split(","):
    try:
        __import__(name)
    except ImportError as e:
        report["errors"][name] = str(e)
print(json.dumps(report))
"""


def _run_installed(target: Path, blocked: str, modules: str, cwd: Path) -> dict:
    site = sysconfig.get_paths()["purelib"]
    out = subprocess.run([sys.executable, "-S", "-c", _CLEAN, str(target), site, blocked, modules],
                         cwd=cwd, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--target", str(target), str(built[0])], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return target


@pytest.mark.slow
def test_the_installed_wheel_runs_the_engine_without_the_checkout(installed, tmp_path):
    got = _run_installed(installed, "", "minillm.engine,minillm.serve,minillm.lab.spec_replay", tmp_path)
    assert Path(got["file"]).is_relative_to(installed), got["file"]
    assert len(got["tokens"]) == 4 and got["errors"] == {} and got["priors"] > 0


@pytest.mark.slow
def test_without_the_extras_the_engine_runs_and_the_server_names_its_extra(installed, tmp_path):
    got = _run_installed(installed, "starlette,uvicorn,openai,httpx,matplotlib,ipywidgets",
                         "minillm.serve,minillm.viz", tmp_path)
    assert len(got["tokens"]) == 4                       # the engine needs no extra
    assert "minillm[serve]" in got["errors"]["minillm.serve"], got["errors"]
    assert "minillm[viz]" in got["errors"]["minillm.viz"], got["errors"]
