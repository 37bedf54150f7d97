"""benchmarks.baseline: the package of another commit, exported and timed beside this checkout.

No clock is checked. What is: the exported tree is the commit's, file for file and byte for byte;
each probe process runs the package it was given (not whatever `import minillm` finds first);
the two take turns and both report; bad input is refused with the argument's name.
"""
import subprocess

import pytest

from benchmarks import baseline


def _root_or_skip():
    try:
        return baseline.repo_root()
    except RuntimeError as e:                      # an installed wheel, no git: nothing to export
        pytest.skip(str(e))


def _git(root, *args) -> bytes:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout


def test_export_is_the_commit_file_for_file(tmp_path):
    root = _root_or_skip()
    full = baseline.export("HEAD", tmp_path)
    assert full == _git(root, "rev-parse", "HEAD").decode().strip()
    listed = set(_git(root, "ls-tree", "-r", "--name-only", full, "minillm").decode().split())
    exported = {p.relative_to(tmp_path).as_posix() for p in (tmp_path / "minillm").rglob("*")
                if p.is_file()}
    assert exported == listed and "minillm/__init__.py" in listed
    for path in ("minillm/__init__.py", "minillm/engine/llm_engine.py"):
        assert (tmp_path / path).read_bytes() == _git(root, "show", f"{full}:{path}")


def test_compare_times_both_trees_in_turn():
    _root_or_skip()
    r = baseline.compare("HEAD", rounds=2, steps=1, warmup_rounds=0, batches=(1, 2))
    assert len(r["commit"]) == 7 and r["rounds"] == 2
    for side in ("baseline_engine_ms", "current_engine_ms"):
        assert set(r[side]) == {"batch1", "batch2"} and all(v > 0 for v in r[side].values())
    assert all(v > 0 for v in r["baseline_over_current"].values())
    assert "batch2" in baseline.report(r)


def test_a_probe_refuses_a_tree_without_the_package(tmp_path):
    # the process would import the installed minillm instead: that must not pass as the tree's
    with pytest.raises(RuntimeError, match="not the package under"):
        baseline.Probe(tmp_path, threads=1, batches=(1,), steps=1, total_steps=1)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="rounds"):
        baseline.compare(rounds=0)
    with pytest.raises(ValueError, match="batches"):
        baseline.compare(batches=())
    with pytest.raises(ValueError, match="batches"):
        baseline.compare(batches=(0,))
    _root_or_skip()
    for bad in ("no-such-commit-0123", "--output=x", ""):
        with pytest.raises(ValueError, match="commit"):
            baseline.export(bad, tmp_path)


def test_the_command_says_what_is_wrong(capsys):
    assert baseline.main(["--help"]) == 2 and "usage" in capsys.readouterr().err
    assert baseline.main(["a", "b"]) == 2
    _root_or_skip()
    assert baseline.main(["no-such-commit-0123"]) == 1
    assert "commit must name a commit" in capsys.readouterr().err
