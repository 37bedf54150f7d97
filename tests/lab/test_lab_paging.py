"""minillm.lab.paging: the shape of its answer and its bad-input errors (no speed is asserted)."""
import pytest

from minillm.lab.paging import time_paged_vs_block_size


def test_block_size_timing_shape_and_bad_input():
    """The chapter's timing helper returns one positive time per candidate (speed is never asserted)."""
    t = time_paged_vs_block_size(block_sizes=(1, 4), batch=2, context_len=8, n_head=2, n_kv_head=1,
                                 head_dim=4, rounds=1)
    assert set(t) == {"dense", 1, 4} and all(x > 0 for x in t.values())
    with pytest.raises(ValueError, match="n_head"):
        time_paged_vs_block_size(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="block_sizes"):
        time_paged_vs_block_size(block_sizes=(0,))
    with pytest.raises(ValueError, match="rounds"):
        time_paged_vs_block_size(rounds=0)
