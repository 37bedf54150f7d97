"""Chapter 3's exercise checks accept the right answer (computed here independently, by
arithmetic or enumeration) and reject wrong answers and planted-broken code."""
import math

import pytest

from minillm import exercises


def test_all_keys_registered():
    assert list(exercises.list_exercises("03")) == ["03.1", "03.2", "03.3", "03.4", "03.5"]


def test_03_1_waste():
    lengths, P = [37, 5, 16, 100], 16
    slots = sum(math.ceil(n / P) * P for n in lengths)         # 48 + 16 + 16 + 112 = 192
    right = 1 - sum(lengths) / slots
    assert exercises.check("03.1", right)
    assert not exercises.check("03.1", 1 - sum(lengths) / (len(lengths) * 128))  # a wrong P
    assert not exercises.check("03.1", (P - 1) / 2 * len(lengths) / slots)       # the estimate
    assert not exercises.check("03.1", "0.18")                                   # not a number


def test_03_2_prefix_reuse_is_block_by_block():
    P, differs_at = 16, 37
    assert exercises.check("03.2", differs_at // P * P)        # blocks 0 and 1 are untouched
    assert not exercises.check("03.2", 0)                      # "exact match from the start"
    assert not exercises.check("03.2", 49)                     # everything but the last token


def test_03_3_cow_copies():
    n, prompt, P, gen = 4, 37, 16, 7
    partial = prompt % P != 0                                  # the last prompt block is shared
    new_blocks = (prompt + gen - 1) // P != (prompt - 1) // P  # 44 tokens stay in block 2
    assert not new_blocks
    assert exercises.check("03.3", (n - 1) * partial)         # the last writer owns the original
    assert not exercises.check("03.3", n)
    assert not exercises.check("03.3", n * gen)


def _slot_mapping(table, block_size, start, end):
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def test_03_4_slot_mapping_right_and_broken(capsys):
    assert exercises.check("03.4", _slot_mapping)
    broken = [
        lambda t, P, s, e: [t[p // P] + p % P for p in range(s, e)],          # forgot * P
        lambda t, P, s, e: [t[p % P] * P + p // P for p in range(s, e)],      # swapped // and %
        lambda t, P, s, e: list(range(s, e)),                                 # contiguous KV
        lambda t, P, s, e: _slot_mapping(t, P, s, e + 1),                     # off by one
        lambda t, P, s, e: None,
    ]
    for fn in broken:
        assert not exercises.check("03.4", fn)
    assert "not yet" in capsys.readouterr().out


def _release(table, ref_counts):
    freed = []
    for b in reversed(table):
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            freed.append(b)
    return freed


def test_03_5_release_right_and_broken():
    assert exercises.check("03.5", _release)

    def ignores_refcount(table, ref_counts):                   # frees shared blocks too
        for b in table:
            ref_counts[b] = 0
        return list(reversed(table))

    def front_first(table, ref_counts):                        # right blocks, wrong order
        return list(reversed(_release(table, ref_counts)))

    def no_decrement(table, ref_counts):
        return [b for b in reversed(table) if ref_counts[b] == 1]

    def crashes(table, ref_counts):
        raise IndexError("oops")

    for fn in (ignores_refcount, front_first, no_decrement, crashes):
        assert not exercises.check("03.5", fn)


def test_release_reference_agrees_with_block_manager():
    """The test's own reference frees what BlockManager.free frees, in the same order."""
    from minillm.paging.block_manager import BlockManager
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(10)))                          # blocks 0, 1, 2
    bm.fork("a", "b")
    bm.append_tokens("b", [7])                                 # b copies block 2 -> 3
    refs = [bm.ref_count(b) for b in range(8)]
    table = bm.block_table("b")
    before = set(bm.free_block_ids())
    freed = _release(table, refs)
    bm.free("b")
    assert refs == [bm.ref_count(b) for b in range(8)]
    assert freed == [b for b in bm.free_block_ids() if b not in before] == [3]


@pytest.mark.parametrize("key", ["03.1", "03.2", "03.3"])
def test_numeric_checks_never_print_the_answer(key, capsys):
    exercises.check(key, -1)
    out = capsys.readouterr().out
    assert out.startswith(f"{key} not yet") and "32" not in out and "0.177" not in out

