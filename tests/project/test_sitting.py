"""The course's size as the README quotes it: words, code lines, figures and minutes per notebook
(benchmarks/sitting.py), checked on a notebook built here and against the README's table."""
import json
import re
from pathlib import Path

from benchmarks.sitting import course_size, notebook_size, RECORDS
from benchmarks.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


def _nb(tmp_path, cells):
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return p


def test_counts_prose_code_and_figures(tmp_path):
    md = {"cell_type": "markdown", "source": ["# Title\n", "Two words, and 3 more."], "metadata": {}}
    code = {"cell_type": "code", "source": ["# a comment\n", "x = 1\n", "\n", "print(x)\n"], "metadata": {},
            "outputs": [{"output_type": "display_data", "data": {"image/png": "AAAA"}, "metadata": {}}],
            "execution_count": 1}
    s = notebook_size(_nb(tmp_path, [md, code]))
    assert (s["words"], s["code_lines"], s["figures"]) == (6, 2, 1)
    assert s["minutes"] == 5          # rounded to 5, at least 5


def test_every_record_in_the_sitting_is_a_benchmark():
    assert set(RECORDS) <= set(BENCHMARKS)


def test_readme_reading_times_match_the_count():
    """Each chapter row of the README says ~N min; N is the sum over that row's notebooks, within
    10 minutes (a reworded paragraph need not touch the README)."""
    size = {s["notebook"]: s["minutes"] for s in course_size()}
    rows = [l for l in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| \d\d \|", l)]
    assert rows
    seen = set()
    for row in rows:
        nbs = re.findall(r"notebooks/([\w.]+\.ipynb)", row)
        m = re.search(r"~(\d+) min", row)
        assert nbs and m, row
        seen.update(nbs)
        assert abs(int(m.group(1)) - sum(size[n] for n in nbs)) <= 10, (row[:60], sum(size[n] for n in nbs))
    assert seen == set(size), "every notebook has a row in the README's chapter table"


def test_bad_arguments_fail_before_any_run(tmp_path, monkeypatch):
    """A misspelt notebook, or --append with no record to add to, stops the sitting at once
    (ValueError naming the flag), not after the records have run."""
    import pytest
    from benchmarks import sitting
    ran = []
    monkeypatch.setattr(sitting, "_run", lambda *a, **k: ran.append(a) or True)
    with pytest.raises(ValueError, match="--notebooks: no such notebook 99_nope.ipynb"):
        sitting.main(["--records", "spec", "--notebooks", "99_nope.ipynb"])
    import benchmarks.records as records
    monkeypatch.setattr(records, "results_dir", lambda: tmp_path / "results")
    with pytest.raises(ValueError, match="--append: there is no sitting record"):
        sitting.main(["--append", "--records", "spec", "--no-notebooks"])
    assert ran == []
