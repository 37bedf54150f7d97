"""The worked examples in the core modules' docstrings run and print what they say (review T12).

`make test` runs this file, so a docstring example that drifts from the code fails the suite.
Examples elsewhere (`load_model`, `ledger_for`) show calls on the real model or a results ledger
and are illustrations, not doctests.
"""
import doctest
import importlib

import pytest

CORE = ["minillm.paging.block_manager", "minillm.paging.host_tier", "minillm.model.sampling",
        "minillm.spec.rejection", "minillm.spec.tree", "minillm._validate"]


@pytest.mark.parametrize("name", CORE)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring example to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
