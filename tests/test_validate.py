"""The shared argument checks: the type rule, the range rule, NaN and infinity, open bounds."""
import math

import pytest

from minillm._validate import ArgumentTypeError, check_int, check_real


@pytest.mark.parametrize("value", [True, 2.0, "3", None])
def test_wrong_types_are_both_type_and_value_errors(value):
    with pytest.raises(TypeError, match="n must be an int >= 1"):
        check_int("n", value, 1)
    with pytest.raises(ValueError):
        check_int("n", value, 1)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)


def test_int_bounds_are_inclusive():
    assert check_int("n", 1, 1, 3) == 1 and check_int("n", 3, 1, 3) == 3
    for bad in (0, 4):
        with pytest.raises(ValueError, match=r"n must be an int in \[1, 3\], got"):
            check_int("n", bad, 1, 3)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_reals_must_be_finite(value):
    with pytest.raises(ValueError, match="x must be finite"):
        check_real("x", value)


def test_real_open_and_closed_bounds():
    assert check_real("p", 1, 0, 1, low_open=True) == 1.0
    with pytest.raises(ValueError, match=r"p must be a real number in \(0, 1\], got 0"):
        check_real("p", 0, 0, 1, low_open=True)
    with pytest.raises(ValueError, match=r"< 1"):
        check_real("p", 1, high=1, high_open=True)
    with pytest.raises(TypeError):
        check_real("p", True)
