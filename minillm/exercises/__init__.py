"""Checks for the chapters' exercises: the reader answers, the check says right or not yet.

    >>> from minillm import exercises
    >>> exercises.check("00.1", 999)              # doctest: +SKIP
    00.1 not yet: ...

- `check(key, answer)` returns True or False and prints one line. A numeric answer is compared,
  within the exercise's tolerance, with a value minillm computes on the reader's machine; the
  expected value is never printed, and a wrong answer is only called wrong (never "too high",
  which would allow bisection); the hint says what to recompute. A code exercise runs a named
  test on the reader's function (or class), one that fails on a broken version.
- `list_exercises(chapter=None)` returns the keys and questions, chapter by chapter.

Each chapter's exercises live in `chNN.py` beside this file and register themselves with
`numeric(...)` or `code(...)`; the file is imported the first time one of its keys is asked for.
Keys are "CC.N": chapter CC, exercise N, as numbered in the notebook.
"""
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["check", "list_exercises", "numeric", "code", "call_reader", "Exercise"]


@dataclass(frozen=True)
class Exercise:
    key: str
    question: str
    judge: Callable[[Any], tuple[bool, str]]    # answer -> (right?, a line that never holds the answer)
    expected: Callable[[], float] | None = None  # numeric exercises: the answer, for the course's own tests
    rtol: float = 0.0
    atol: float = 0.0


_REGISTRY: dict[str, Exercise] = {}
_CHAPTERS = [f"{c:02d}" for c in range(12)]


def _register(ex: Exercise) -> Exercise:
    if ex.key in _REGISTRY:
        raise ValueError(f"exercise {ex.key!r} is registered twice")
    _REGISTRY[ex.key] = ex
    return ex


def numeric(key: str, question: str, expected: Callable[[], float], *, rtol: float = 0.01,
            atol: float = 0.0, hint: str = "") -> Exercise:
    """Register a numeric exercise. `expected()` computes the answer when the reader checks (on
    their machine, with minillm's functions); an answer within rtol (relative) or atol (absolute)
    of it is right."""
    def judge(answer):
        if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
            return False, f"answer must be a finite number, got {answer!r}"
        want = float(expected())
        if math.isclose(float(answer), want, rel_tol=rtol, abs_tol=atol):
            return True, "right"
        # right or wrong only: saying "too high" or "too low" would let any answer be found by bisection
        return False, f"not yet: that is not it ({_tolerance(rtol, atol)}); recompute" + (
            f". Hint: {hint}" if hint else "")
    return _register(Exercise(key, question, judge, expected=expected, rtol=rtol, atol=atol))


def _tolerance(rtol: float, atol: float) -> str:
    if rtol == 0 and atol == 0:
        return "checked exactly"
    parts = ([f"within {rtol * 100:g}%"] if rtol else []) + ([f"within {atol:g}"] if atol else [])
    return "checked " + " or ".join(parts)


def code(key: str, question: str, test: Callable[[Any], None], *, hint: str = "") -> Exercise:
    """Register a code exercise. `test(candidate)` raises AssertionError (with a message that does
    not give the fix away) when the candidate is wrong, and returns when it is right."""
    def judge(candidate):
        try:
            test(candidate)
        except AssertionError as e:
            return False, f"not yet: {e}" + (f". Hint: {hint}" if hint else "")
        return True, "right"
    return _register(Exercise(key, question, judge))


def call_reader(fn, *args):
    """Run the reader's function inside a code exercise's test: an exception it raises becomes a
    wrong answer ("not yet: your function raised ...") instead of crashing the check."""
    try:
        return fn(*args)
    except Exception as e:  # the reader's code, not ours
        raise AssertionError(f"your function raised {type(e).__name__}: {e}") from e


def _load(chapter: str) -> None:
    try:
        importlib.import_module(f"minillm.exercises.ch{chapter}")
    except ModuleNotFoundError as e:
        if e.name != f"minillm.exercises.ch{chapter}":
            raise


def _get(key: str) -> Exercise:
    if not isinstance(key, str):
        raise TypeError(f"key must be a string like '03.2', got {type(key).__name__}")
    chapter = key.partition(".")[0]
    if chapter in _CHAPTERS:
        _load(chapter)
    if key not in _REGISTRY:
        known = ", ".join(sorted(k for k in _REGISTRY if k.startswith(chapter + "."))) or "none"
        raise ValueError(f"no exercise {key!r}; chapter {chapter!r} has: {known}")
    return _REGISTRY[key]


def check(key: str, answer: Any) -> bool:
    """Judge `answer` for exercise `key`; print one line and return True when it is right."""
    ok, line = _get(key).judge(answer)
    print(f"{key} {line}")
    return ok


def list_exercises(chapter: str | None = None) -> dict[str, str]:
    """{key: question} for one chapter ("03") or for all of them."""
    for c in ([chapter] if chapter is not None else _CHAPTERS):
        _load(c)
    return {k: e.question for k, e in sorted(_REGISTRY.items())
            if chapter is None or k.startswith(f"{chapter}.")}
