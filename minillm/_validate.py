"""Argument checks shared by every module: one rule per kind of value, one message style.

A value of the wrong type raises `ArgumentTypeError`, which is both a TypeError and a
ValueError (so callers written against either keep working); a value of the right type out of
range, NaN or infinite raises ValueError. Every message names the argument and what is allowed.

    >>> check_int("block_size", 16, low=1)
    16
    >>> check_int("block_size", 0, low=1)
    Traceback (most recent call last):
    ...
    ValueError: block_size must be an int >= 1, got 0
    >>> check_real("top_p", 1.5, low=0, high=1, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: top_p must be a real number in (0, 1], got 1.5
"""
import math


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type."""


def _range(kind: str, low, high, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {high}"
    return kind


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` if it is an int (not a bool) in [low, high]; either bound may be None."""
    want = _range("an int", low, high)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return value


def check_real(name: str, value, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """float(value) if it is a finite int or float (not a bool) within the bounds; `low_open`
    and `high_open` exclude the bound itself."""
    want = _range("a real number", low, high, low_open, high_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite ({want}), got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    try:
        return float(value)
    except OverflowError:                       # an int past every float: not finite either
        raise ValueError(f"{name} must be finite ({want}), got an int of "
                         f"{value.bit_length()} bits") from None


def check_token_ids(token_ids, allow_empty: bool = False) -> list[int]:
    """A copy of `token_ids` as a list if it is a list or tuple of ints (non-empty unless
    `allow_empty`); TypeError / ValueError naming `token_ids` otherwise."""
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    if not token_ids and not allow_empty:
        raise ValueError("token_ids must hold at least one token, got an empty list")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise TypeError("token_ids must be a list of ints")
    return list(token_ids)
