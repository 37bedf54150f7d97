"""No chapter prints an exercise's answer.

Every numeric exercise's answer is computed here, on this machine, by the same function
`exercises.check` judges with; then every number in every notebook's stored outputs is read, and
a number that is the answer as a chapter would print it (rounded to the printed decimals, with
three significant digits, or two in the exercise's own chapter) fails the test, naming the
notebook, the cell and the exercise. The reader must compute the answer, not copy it. In a cell
whose output depends on the machine (`# NBVAL_IGNORE_OUTPUT`: timings), only three digits in the
exercise's own chapter count: elsewhere a timing that equals an answer is chance, and changes from
run to run.

Small integers (|answer| < 100) are left out of the grep: a "5" or a "16" appears in any output
for other reasons. Their exercises are kept honest by asking about numbers the chapter does not use.
"""
import json
import math
import re
from pathlib import Path

import pytest

from minillm import exercises
from minillm.exercises import _REGISTRY, list_exercises

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\d)")


CHECK_KEY = re.compile(r"^\d\d\.\d+(?= )", re.M)     # "10.1 not yet: ...": the key `check` prints


def _outputs(nb: Path):
    """(cell index, whether the cell is machine-dependent, text) of every stored output of a notebook; the exercise key that opens each
    line `exercises.check` prints is a name, not a number, and is left out."""
    cells = json.loads(nb.read_text())["cells"]
    for i, c in enumerate(cells):
        measured = "".join(c.get("source", "")).lstrip().startswith("# NBVAL_IGNORE_OUTPUT")
        for o in c.get("outputs", []):
            text = o.get("text") or (o.get("data") or {}).get("text/plain") or ""
            text = CHECK_KEY.sub("", "".join(text) if isinstance(text, list) else text)
            # the banner's bandwidth and load are this machine's, not a chapter's result
            yield i, measured, "\n".join(l for l in text.splitlines() if not l.startswith("machine: "))


def _decimals(token: str) -> int:
    mant = token.lower().split("e")[0]
    return len(mant.split(".")[1]) if "." in mant else 0


def _sig(token: str) -> int:
    """Significant digits printed: 3 in "0.567", 2 in "0.57", 8 in "94,371,840"."""
    mant = token.lower().split("e")[0].replace(",", "").lstrip("+-").replace(".", "")
    return len(mant.lstrip("0"))


def _gives_away(token: str, want: float, same_chapter: bool, measured: bool = False) -> bool:
    """Is the printed `token` the answer as the chapter would print it: the answer rounded to the
    token's decimals, with at least 3 significant digits printed (2 within the exercise's own
    chapter, where "0.57" next to the question gives away 0.567)? An unrelated "10" or "0.5"
    elsewhere in the course says nothing."""
    try:
        v = float(token.replace(",", ""))
    except ValueError:
        return False
    if "e" in token.lower() or v == 0:
        return False
    # a cell whose output depends on the machine (# NBVAL_IGNORE_OUTPUT) prints timings that differ
    # run to run: there only three digits in the exercise's own chapter count, not a chance "0.71"
    # or a timing ratio elsewhere in the course
    if measured and not same_chapter:
        return False
    if _sig(token) < (2 if same_chapter and not measured else 3):
        return False
    d = _decimals(token)
    return math.isclose(round(want, d), v, rel_tol=1e-12, abs_tol=10 ** -(d + 6))


@pytest.fixture(scope="module")
def answers():
    list_exercises()                       # import every chapter's exercises
    out = {}
    for key, ex in sorted(_REGISTRY.items()):
        if ex.expected is None:
            continue
        want = float(ex.expected())
        if not math.isfinite(want) or want == 0 or (float(want).is_integer() and abs(want) < 100):
            continue
        out[key] = want
    return out


def test_the_grep_finds_a_printed_answer():
    # the test can fail: a printed 0.57 gives away 0.567 checked to 0.5%, 126 gives away 126,
    # "94,371,840" gives away 94371840; an unrelated 0.61 or 125 does not
    assert _gives_away("0.57", 0.567, same_chapter=True)
    assert not _gives_away("0.57", 0.567, same_chapter=False)
    assert _gives_away("126", 126, same_chapter=False)
    assert _gives_away("94,371,840", 94371840, same_chapter=False)
    assert _gives_away("40.6", 40.61, same_chapter=False)
    assert not _gives_away("0.61", 0.567, same_chapter=True)
    assert not _gives_away("125", 126, same_chapter=True)
    assert _gives_away("0.567", 0.567, same_chapter=True, measured=True)
    assert not _gives_away("0.57", 0.567, same_chapter=True, measured=True)
    assert not _gives_away("0.655", 0.655, same_chapter=False, measured=True)
    toks = NUMBER.findall("step 12: 94,371,840 bytes, ratio 0.57x, v1.2.3 and 1e-3")
    assert "94,371,840" in toks and "0.57" in toks and "1e-3" in toks
    # an exercise's key at the start of the line `check` prints is not an answer
    assert NUMBER.findall(CHECK_KEY.sub("", "10.1 not yet: off by 10.1")) == ["10.1"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_stored_output_prints_an_answer(nb, answers):
    found = []
    for i, measured, text in _outputs(nb):
        for tok in set(NUMBER.findall(text)):
            for key, want in answers.items():
                if _gives_away(tok, want, same_chapter=key[:2] == nb.stem[:2], measured=measured):
                    found.append(f"cell {i} prints {tok}, the answer to {key}")
    assert not found, f"{nb.name}: " + "; ".join(sorted(found))
