"""Chapter 3 exercises (the paged KV cache). Each answer is judged against minillm's own
`BlockManager` run on the reader's machine; code exercises run the reader's function through a
test that a planted-broken version fails.

    >>> from minillm import exercises
    >>> exercises.check("03.1", 0.5)              # doctest: +SKIP
    03.1 not yet: that is not it (...); recompute. Hint: ...
"""
import random

from minillm.exercises import call_reader as _call, code, numeric
from minillm.paging.block_manager import BlockManager

WASTE_LENGTHS, WASTE_P = [37, 5, 16, 100], 16


def _head(values) -> str:
    """The first few values the reader's function returned, for the message."""
    if not isinstance(values, (list, tuple)):
        return repr(values)
    return repr(list(values[:6])) + (" ..." if len(values) > 6 else "")


def _waste() -> float:
    bm = BlockManager(num_blocks=64, block_size=WASTE_P)
    for i, n in enumerate(WASTE_LENGTHS):
        bm.allocate(i, [0] * n)
    return 1 - sum(WASTE_LENGTHS) / (bm.num_used_blocks * WASTE_P)


numeric("03.1", f"Sequences of {WASTE_LENGTHS} tokens are stored in blocks of P={WASTE_P}. What "
        "fraction of the allocated KV slots is empty (a number between 0 and 1)?",
        _waste, rtol=0.005, hint="recount in whole blocks: each sequence holds all of its last "
        "block, full or not")


def _cached_tokens() -> int:
    bm = BlockManager(num_blocks=16, block_size=16, enable_prefix_caching=True)
    first = list(range(100, 150))                          # a 50-token prompt
    bm.allocate("a", first)
    bm.mark_computed("a", len(first))
    second = first[:37] + [999] + first[38:]               # differs at token 37 only
    return bm.allocate("b", second)


numeric("03.2", "A 50-token prompt's KV is in the prefix cache (P=16). A new 50-token prompt is the "
        "same except for token 37 (counting from 0). How many tokens does allocate report cached?",
        _cached_tokens, rtol=0, atol=0.5, hint="reuse stops at the first block that differs")


def _cow_copies() -> int:
    bm = BlockManager(num_blocks=32, block_size=16)
    bm.allocate(0, list(range(37)))                         # the prompt, prefilled once
    bm.mark_computed(0, 37)
    for child in (1, 2, 3):
        bm.fork(0, child)
    for t in range(7):                                      # every completion writes 7 tokens
        for s in range(4):
            bm.append_tokens(s, [1000 * s + t])
    return bm.stats["cow_copies"]


numeric("03.3", "n=4 completions are forked from a 37-token prompt after its prefill (P=16). Each "
        "then writes 7 tokens. How many copy-on-write block copies happen in total?",
        _cow_copies, rtol=0, atol=0.5,
        hint="a copy happens only when a sequence writes into a shared, partly filled block")


def _test_slot_mapping(fn) -> None:
    """fn(table, block_size, start, end) -> physical slots of positions start..end-1."""
    rng = random.Random(3)
    for _ in range(200):
        P = rng.choice([1, 2, 3, 4, 8, 16])
        ids = list(range(40))
        rng.shuffle(ids)
        table = ids[:rng.randint(1, 8)]
        n = len(table) * P - rng.randint(0, P - 1)            # tokens the table holds
        start = rng.randint(0, n)
        end = rng.randint(start, n)
        # the reference walks the pool slot by slot: block b holds slots b*P .. b*P+P-1
        want = [[b * P + o for b in table for o in range(P)][p] for p in range(start, end)]
        got = _call(fn, list(table), P, start, end)
        assert got is not None and list(got) == want, (f"table={table}, block_size={P}, positions {start}..{end - 1}: "
                                   f"got {_head(got)}")


code("03.4", "Write slot_mapping(table, block_size, start, end) -> list of the physical KV slots "
     "of token positions start..end-1 of a sequence with that block table.",
     _test_slot_mapping, hint="a position's slot comes from its block's physical id in "
     "the table and its offset inside that block (section 1)")


def _test_release(fn) -> None:
    """fn(table, ref_counts) decrements each block's count; returns blocks that reached 0, tail first."""
    rng = random.Random(5)
    for _ in range(200):
        n_blocks = rng.randint(2, 12)
        table = rng.sample(range(n_blocks), rng.randint(1, n_blocks))
        refs = [rng.randint(1, 3) if b in table else rng.randint(0, 2) for b in range(n_blocks)]
        want_refs = [r - (b in table) for b, r in enumerate(refs)]
        want_freed = [b for b in reversed(table) if want_refs[b] == 0]
        got_refs = list(refs)
        freed = _call(fn, list(table), got_refs)
        assert got_refs == want_refs, (f"table={table}, ref_counts={refs}: ref_counts became "
                                       f"{got_refs}")
        assert freed is not None and list(freed) == want_freed, (f"table={table}, ref_counts={refs}: returned "
                                           f"{_head(freed)} as free")


code("03.5", "Write release(table, ref_counts): a sequence with this block table is finished. "
     "Decrement the refcount of each of its blocks (in place) and return the blocks that are now "
     "free (refcount 0), last logical block first.",
     _test_release, hint="a block another sequence still holds is not free; walk the table backwards")
