"""Block manager tests.

The trusted reference is an emulated KV memory: every physical slot holds the token prefix
whose KV was written there (the KV of position p depends on tokens 0..p). The runner model in
`Machine` writes only what the block tables say and copies only what copy-on-write says, so a
wrong prefix-cache hit, a missing copy or a write into a shared block shows up as a slot
whose content differs from the sequence's own prefix.
"""
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from minillm.paging.block_manager import BlockManager, NoFreeBlocksError


class CollidingBlockManager(BlockManager):
    """Every block hashes alike: only the token and parent checks keep hits correct."""

    def block_hash(self, parent_hash, tokens):
        return 0


class ParentBlindBlockManager(BlockManager):
    """A hash that ignores the parent: equal blocks after different prefixes collide."""

    def block_hash(self, parent_hash, tokens):
        return hash(tokens)


MANAGERS = {"plain": BlockManager, "colliding": CollidingBlockManager,
            "parent_blind": ParentBlindBlockManager}


def snapshot(bm: BlockManager):
    return ({s: (bm.block_table(s), bm.token_ids(s), bm.num_computed_tokens(s)) for s in bm.seq_ids()},
            [bm.ref_count(b) for b in range(bm.num_blocks)], bm.free_block_ids())


def full_state(bm: BlockManager):
    """snapshot() plus what a probe must not change either: cache membership and statistics."""
    return snapshot(bm), [bm.is_cached(b) for b in range(bm.num_blocks)], dict(bm.stats)


def check_free_lists(bm: BlockManager):
    """The free list caches nothing; every evictable block (the LRU after it) is cached."""
    free = bm.free_block_ids()
    plain = len(free) - bm.num_evictable_blocks
    assert not any(bm.is_cached(b) for b in free[:plain])
    assert all(bm.is_cached(b) for b in free[plain:])


# ---- property test: random operation sequences ------------------------------------------------
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocab: many shared prefixes


class Machine(RuleBasedStateMachine):
    @initialize(P=st.integers(1, 5), N=st.integers(1, 20), caching=st.booleans(),
                kind=st.sampled_from(sorted(MANAGERS)))
    def setup(self, P, N, caching, kind):
        self.bm = MANAGERS[kind](N, P, caching)
        self.kv = {}       # slot -> tuple of tokens whose KV sits there
        self.next_id = 0
        # liveness: the token lists whose KV was fully written, and how many blocks have left the
        # cache so far. Every removal (LRU eviction, an overwrite after truncate, a stale entry)
        # goes through PrefixCache.uncache, which is counted here.
        self.uncached, self.computed = 0, {}   # prompt -> self.uncached when it was computed
        real = self.bm.prefix_cache.uncache

        def counted(b, seqs):
            self.uncached += 1
            real(b, seqs)
        self.bm.prefix_cache.uncache = counted

    def seqs(self):
        return self.bm.seq_ids()

    def _write(self, s):
        """Run the 'forward pass' of seq s: write KV for its uncomputed tokens."""
        bm, P = self.bm, self.bm.block_size
        toks, table = bm.token_ids(s), bm.block_table(s)
        for p in range(bm.num_computed_tokens(s), len(toks)):
            b = table[p // P]
            assert bm.ref_count(b) == 1, f"write into shared block {b} (refcount {bm.ref_count(b)})"
            assert not bm.is_cached(b), f"write into prefix-cached block {b}"
            self.kv[b * P + p % P] = tuple(toks[:p + 1])
        bm.mark_computed(s, len(toks))
        self.computed[tuple(toks)] = self.uncached

    @rule(prompt=tokens_st, compute=st.booleans())
    def allocate(self, prompt, compute):
        bm, s = self.bm, self.next_id
        self.next_id += 1
        try:
            ok = bm.can_allocate(prompt)
        except ValueError:  # could never fit in the pool
            assert bm.blocks_needed(len(prompt)) > bm.num_blocks
            return
        before = full_state(bm)
        if not ok:
            with pytest.raises(NoFreeBlocksError):
                bm.allocate(s, prompt)
            assert full_state(bm) == before
            return
        cached = bm.allocate(s, prompt)
        assert cached % bm.block_size == 0 and 0 <= cached <= len(prompt) - 1
        assert cached == 0 or bm.enable_prefix_caching
        if self._still_cached(prompt):   # liveness: a computed identical prompt is hit in full
            assert cached == (len(prompt) - 1) // bm.block_size * bm.block_size
        if compute:
            self._write(s)

    def _still_cached(self, prompt) -> bool:
        """The prompt's KV was fully written and no block has left the cache since. (A
        colliding hash may refuse to register a block, so only the real hash is held to it.)"""
        return (self.bm.enable_prefix_caching and type(self.bm) is BlockManager
                and self.computed.get(tuple(prompt), -1) == self.uncached)

    @rule(data=st.data(), prompt=tokens_st, new=st.integers(0, 6))
    def probe(self, data, prompt, new):
        """The "can I?" questions change nothing, statistics and the LRU order included."""
        bm, before = self.bm, full_state(self.bm)
        try:
            bm.can_allocate(prompt)
        except ValueError:
            pass
        if self.seqs():
            bm.can_append(data.draw(st.sampled_from(self.seqs())), new)
        assert full_state(bm) == before

    @precondition(lambda self: self.seqs())
    @rule(data=st.data())
    def reallocate_computed(self, data):
        """Liveness, head on: write a sequence's KV, free it, allocate the same tokens again."""
        bm = self.bm
        s = data.draw(st.sampled_from(self.seqs()))
        self._write(s)
        toks = bm.token_ids(s)
        bm.free(s)
        t = self.next_id
        self.next_id += 1
        if toks and bm.can_allocate(toks):  # (blocks shared with a fork were not freed)
            cached = bm.allocate(t, toks)
            if self._still_cached(toks):
                assert cached == (len(toks) - 1) // bm.block_size * bm.block_size

    @precondition(lambda self: self.seqs())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new):
        bm, P = self.bm, self.bm.block_size
        s = data.draw(st.sampled_from(self.seqs()))
        self._write(s)  # the runner writes pending KV before the next tokens are added
        before = snapshot(bm)
        if not bm.can_append(s, len(new)):
            with pytest.raises(NoFreeBlocksError):
                bm.append_tokens(s, new)
            assert snapshot(bm) == before
            return
        old_table = bm.block_table(s)
        copies = bm.append_tokens(s, new)
        assert len(copies) <= 1
        for src, dst in copies:
            assert src == old_table[-1] and bm.block_table(s)[len(old_table) - 1] == dst
            assert bm.ref_count(dst) == 1 and bm.ref_count(src) >= 1
            for off in range(P):
                if src * P + off in self.kv:
                    self.kv[dst * P + off] = self.kv[src * P + off]
        if data.draw(st.booleans()):
            self._write(s)

    @precondition(lambda self: self.seqs())
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self.seqs()))
        self._write(s)  # fork after the parent's KV is written
        self.bm.fork(s, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.seqs())
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.seqs()))
        n = data.draw(st.integers(0, self.bm.num_tokens(s)))
        self.bm.truncate(s, n)
        assert self.bm.num_tokens(s) == n and self.bm.num_computed_tokens(s) <= n

    @precondition(lambda self: self.seqs())
    @rule(data=st.data())
    def free(self, data):
        self.bm.free(data.draw(st.sampled_from(self.seqs())))

    @invariant()
    def refcounts_match_tables(self):
        bm, holders = self.bm, [0] * self.bm.num_blocks
        for s in bm.seq_ids():
            table = bm.block_table(s)
            assert len(set(table)) == len(table)
            assert len(table) == bm.blocks_needed(bm.num_tokens(s))
            for b in table:
                holders[b] += 1
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == holders
        free = bm.free_block_ids()
        assert len(free) == len(set(free)) == bm.num_free_blocks
        assert set(free) == {b for b in range(bm.num_blocks) if holders[b] == 0}
        check_free_lists(bm)

    @invariant()
    def computed_kv_is_the_sequences_own(self):
        bm, P = self.bm, self.bm.block_size
        for s in bm.seq_ids():
            toks, table = bm.token_ids(s), bm.block_table(s)
            for p in range(bm.num_computed_tokens(s)):
                assert self.kv.get(table[p // P] * P + p % P) == tuple(toks[:p + 1]), (s, p)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for s in self.seqs():
            self.bm.free(s)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


Machine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestRandomOperations = Machine.TestCase


# ---- worked examples ---------------------------------------------------------------------------
def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("x", [1, 2, 3])
    bm.allocate("a", list(range(10)))
    assert bm.block_table("a") == [1, 2, 3]
    assert bm.slot_mapping("a", 3, 6) == [4 + 3, 8 + 0, 8 + 1]
    assert bm.num_free_blocks == 2 and bm.num_used_blocks == 4


def test_append_allocates_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [5])
    sizes = []
    for t in range(7):
        assert bm.append_tokens("a", [t]) == []
        sizes.append(len(bm.block_table("a")))
    assert sizes == [1, 2, 2, 3, 3, 4, 4]
    assert not bm.can_append("a") and bm.can_append("a", 0)
    with pytest.raises(NoFreeBlocksError):
        bm.append_tokens("a", [9])
    assert bm.num_tokens("a") == 8


def test_fork_then_copy_on_write_step_by_step():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", list(range(6)))            # blocks [0, 1], block 1 half full
    bm.fork("p", "c")
    assert [bm.ref_count(b) for b in (0, 1)] == [2, 2]
    assert bm.append_tokens("c", [100]) == [(1, 2)]    # c copies block 1, writes into 2
    assert bm.block_table("c") == [0, 2] and bm.block_table("p") == [0, 1]
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert bm.append_tokens("p", [200]) == []          # p owns block 1 alone now: no copy
    assert bm.append_tokens("c", [1, 2]) == []         # fills block 2, opens block 3
    assert bm.block_table("c") == [0, 2, 3]
    bm.free("p")
    assert bm.ref_count(0) == 1 and bm.ref_count(1) == 0
    bm.free("c")
    assert bm.num_free_blocks == 8


def test_full_shared_blocks_are_never_copied():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", list(range(8)))
    bm.fork("p", "c")
    assert bm.append_tokens("c", [1]) == [] and bm.block_table("c")[:2] == bm.block_table("p")


@pytest.mark.parametrize("P", [1, 3, 4, 16])
@pytest.mark.parametrize("system_len", [0, 5, 16, 31])
def test_prefix_hits_are_what_the_shared_prompt_predicts(P, system_len):
    bm = BlockManager(num_blocks=64, block_size=P, enable_prefix_caching=True)
    system = [7] * system_len
    first = system + [1, 2, 3]
    assert bm.allocate("a", first) == 0
    bm.mark_computed("a", len(first))
    second = system + [4, 5]
    assert bm.allocate("b", second) == (system_len // P) * P
    assert bm.block_table("b")[:system_len // P] == bm.block_table("a")[:system_len // P]
    assert bm.stats["hit_blocks"] == system_len // P


@pytest.mark.parametrize("P", [1, 3, 4])
def test_the_cached_tokens_probe_is_what_allocate_finds(P):
    """`num_cached_tokens` predicts `allocate`'s hit count and changes nothing (not even the LRU)."""
    bm = BlockManager(num_blocks=32, block_size=P, enable_prefix_caching=True)
    bm.allocate("a", list(range(13)))
    bm.mark_computed("a", 13)
    bm.free("a")                                   # cached, evictable
    for i, prompt in enumerate([list(range(13)), list(range(6)) + [99], [5, 6, 7], list(range(20))]):
        before = full_state(bm)
        probe = bm.num_cached_tokens(prompt)
        assert full_state(bm) == before
        assert bm.allocate(f"b{i}", prompt) == probe
    assert "a" not in bm and "b0" in bm            # membership: a dict lookup


@pytest.mark.parametrize("n", [7, 8, 9])
def test_whole_prompt_hit_still_leaves_a_query(n):
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    bm.allocate("a", list(range(n)))
    bm.mark_computed("a", n)
    cached = bm.allocate("b", list(range(n)))
    assert cached == ((n - 1) // 4) * 4 and cached <= n - 1
    hit_blocks = cached // 4
    assert bm.block_table("b")[:hit_blocks] == bm.block_table("a")[:hit_blocks]
    assert bm.ref_count(bm.block_table("b")[-1]) == 1  # the recomputed block is private


def test_no_hit_before_mark_computed_and_none_without_caching():
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4, 5])
    assert bm.allocate("b", [1, 2, 3, 4, 5]) == 0      # a's KV is not written yet
    off = BlockManager(num_blocks=16, block_size=2)
    off.allocate("a", [1, 2, 3])
    off.mark_computed("a", 3)
    assert off.allocate("b", [1, 2, 3]) == 0 and off.num_cached_blocks == 0


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    for name, prompt in (("a", [1, 1, 1]), ("b", [2, 2, 2])):
        bm.allocate(name, prompt)
        bm.mark_computed(name, 3)
        bm.free(name)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.allocate("c", [1, 1, 9]) == 2            # a's cached block comes back
    bm.free("c")                                       # ... and is now the most recent
    bm.allocate("d", [5, 5, 5, 5, 5, 5])               # needs 3 blocks: 2 plain + evict b's
    assert bm.stats["evicted_blocks"] == 1
    bm.free("d")                                       # d never computed: plain free blocks
    assert bm.allocate("e", [2, 2, 2]) == 0            # b's block was the LRU one: gone
    assert bm.allocate("f", [1, 1, 1]) == 2            # a's block survived


def test_colliding_hashes_never_give_wrong_blocks():
    bm = CollidingBlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.mark_computed("a", 5)
    assert bm.allocate("b", [9, 9, 3, 4, 5]) == 0      # same 2nd block, different parent
    # one entry per hash value: the colliding second block was never registered, so the
    # collision costs a hit but never hands out wrong KV
    assert bm.allocate("c", [1, 2, 3, 4, 5]) == 2


def test_a_rewritten_parent_orphans_its_cached_children():
    bm = ParentBlindBlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 1, 2, 2, 0])
    bm.mark_computed("a", 5)                           # caches [1, 1] and [2, 2] after it
    bm.truncate("a", 1)
    bm.append_tokens("a", [5])                         # block 0 now holds [1, 5]
    bm.mark_computed("a", 2)
    # [2, 2] is still cached, but its KV was computed after [1, 1], not after [1, 5]
    assert bm.allocate("b", [1, 5, 2, 2, 9]) == 2


def test_truncate_then_append_does_not_corrupt_the_cache():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.mark_computed("a", 5)
    bm.truncate("a", 3)                                # block 1 ([3, 4]) is half ours again
    bm.append_tokens("a", [8])                         # overwrites slot of token 4
    bm.mark_computed("a", 4)
    assert bm.allocate("b", [1, 2, 3, 4, 0]) == 2      # only [1, 2] is still cached
    assert bm.allocate("c", [1, 2, 3, 8, 0]) == 4


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4])
    before = snapshot(bm)
    assert not bm.can_allocate([1, 2, 3, 4, 5])
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", [1, 2, 3, 4, 5])
    assert snapshot(bm) == before and "b" not in bm.seq_ids()


# ---- known hit-rate losses (never wrong KV): liveness beyond "nothing ever left the cache" ------
def test_a_duplicate_of_an_evicted_owner_is_still_found():
    """A block computed while another block caches the same KV stands in for it: once that
    owner is evicted, the copy takes over its hash (this hit used to be lost)."""
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [0, 0])
    bm.mark_computed("a", 2)                   # block 0 caches [0, 0]
    bm.free("a")
    bm.allocate("b", [0, 0])                   # (len - 1) // P = 0 blocks may hit: block 1
    bm.mark_computed("b", 2)                   # [0, 0] again: block 0 owns the hash, 1 stays out
    bm.append_tokens("b", [0])                 # the pool is short: block 0 is evicted
    assert bm.stats["evicted_blocks"] == 1
    bm.mark_computed("b", 3)
    bm.free("b")                               # block 1 still holds the KV of [0, 0]
    assert bm.allocate("c", [0, 0, 0]) == 2


def test_a_prompt_computed_after_an_orphan_is_found_in_full():
    """An orphaned entry (its parent left the cache) gives its hash up to the same block
    computed again after a live parent (this hit used to be lost: review R10)."""
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4])
    bm.mark_computed("a", 4)                   # [1, 2] and [3, 4] after it are cached
    bm.truncate("a", 1)
    bm.append_tokens("a", [9])                 # [1, 2] is overwritten: [3, 4] is an orphan
    bm.mark_computed("a", 2)
    evicted = bm.stats["evicted_blocks"]
    bm.allocate("x", [1, 2, 3, 4, 5])          # nothing leaves the cache from here on
    bm.mark_computed("x", 5)
    bm.free("x")
    assert bm.allocate("y", [1, 2, 3, 4, 5]) == 4
    assert bm.stats["evicted_blocks"] == evicted
    check_free_lists(bm)                       # the orphan, idle, went to the free list


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, err, words", [
    (dict(num_blocks=4, block_size=0), ValueError, "block_size must be an int >= 1, got 0"),
    (dict(num_blocks=0, block_size=4), ValueError, "num_blocks must be an int >= 1, got 0"),
    (dict(num_blocks=4, block_size=2.5), TypeError, "block_size must be an int"),
    (dict(num_blocks=True, block_size=4), TypeError, "num_blocks must be an int"),
])
def test_bad_pool_shape(kwargs, err, words):
    with pytest.raises(err, match=words):
        BlockManager(**kwargs)


def test_request_larger_than_the_pool_names_both_numbers():
    bm = BlockManager(num_blocks=2, block_size=4)
    for call in (bm.can_allocate, lambda t: bm.allocate("a", t)):
        with pytest.raises(ValueError, match=r"9 tokens needs 3 blocks.*num_blocks=2"):
            call(list(range(9)))


def test_unknown_and_duplicate_sequences():
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(KeyError, match="unknown seq_id 'ghost'"):
        bm.free("ghost")
    bm.allocate("a", [1])
    bm.free("a")
    with pytest.raises(KeyError, match="'a'"):
        bm.free("a")
    bm.allocate("a", [1])
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", [2])
    with pytest.raises(ValueError, match="already allocated"):
        bm.fork("a", "a")
    with pytest.raises(ValueError, match="at least one token"):
        bm.allocate("b", [])
    with pytest.raises(TypeError, match="token_ids"):
        bm.allocate("b", "hello")
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate("a", 5)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.mark_computed("a", 2)
    with pytest.raises(ValueError, match="block_id must be < num_blocks=4"):
        bm.ref_count(4)


# ---- the chapter's measurements, against closed forms -------------------------------------------
def test_simulate_memory_matches_the_closed_form():
    from minillm.viz.paging import simulate_memory
    workload, P, max_len = [(5, 3), (1, 7), (9, 1)], 4, 16
    sim = simulate_memory(workload, max_len=max_len, block_size=P, max_num_seqs=3)
    # all three start at step 0; request i holds p_i + t tokens at step t = 0..o_i
    steps = max(o for _, o in workload) + 1
    used = [sum(p + t for p, o in workload if t <= o) for t in range(steps)]
    alloc = [sum(-(-(p + t) // P) * P for p, o in workload if t <= o) for t in range(steps)]
    reserved = [max_len * sum(t <= o for _, o in workload) for t in range(steps)]
    assert sim["used"].tolist() == used and sim["allocated"].tolist() == alloc
    assert sim["reserved"].tolist() == reserved
    assert sim["paging_waste"] == pytest.approx(1 - sum(used) / sum(alloc))


def test_heavy_tailed_workload_is_seeded_and_clipped():
    from minillm.viz.paging import heavy_tailed_workload
    a = heavy_tailed_workload(num_requests=500, max_len=256, seed=3)
    assert a == heavy_tailed_workload(num_requests=500, max_len=256, seed=3)
    assert all(p >= 1 and o >= 1 and p + o <= 256 for p, o in a)
    with pytest.raises(ValueError, match="num_requests"):
        heavy_tailed_workload(num_requests=0)


@pytest.mark.parametrize("prompt_len, n, gen_len, P", [(100, 4, 20, 16), (32, 3, 5, 16), (7, 2, 1, 4)])
def test_sharing_strategies_by_hand(prompt_len, n, gen_len, P):
    from minillm.viz.paging import sharing_strategies
    r = sharing_strategies(prompt_len, n, gen_len, P)
    full, partial = prompt_len // P, prompt_len % P > 0
    per_seq = -(-(prompt_len + gen_len) // P)
    assert r["no sharing"] == {"blocks": n * per_seq, "cow_copies": 0,
                               "prompt_tokens_computed": n * prompt_len}
    # the full prompt blocks are held once, every completion owns the rest
    assert r["fork + CoW"]["blocks"] == full + n * (per_seq - full)
    assert r["fork + CoW"]["cow_copies"] == (n - 1 if partial else 0)
    assert r["fork + CoW"]["prompt_tokens_computed"] == prompt_len
    recompute = prompt_len - min(full, (prompt_len - 1) // P) * P
    assert r["full blocks only"]["prompt_tokens_computed"] == prompt_len + (n - 1) * recompute
    assert r["full blocks only"]["cow_copies"] == 0


def test_block_table_figure_draws_every_block():
    import matplotlib
    matplotlib.use("Agg")
    from minillm.viz.paging import plot_block_tables, snapshot
    bm = BlockManager(num_blocks=5, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.fork("a", "b")
    fig = plot_block_tables([snapshot(bm)], ["one step"])
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) >= 5 + 2 * 2
    with pytest.raises(ValueError, match="one entry per snapshot"):
        plot_block_tables([snapshot(bm)], ["a", "b"])


def test_a_stand_in_that_takes_over_a_hash_keeps_the_blocks_cached_behind_it():
    """Found by the random-operations test: [0, 1] is cached in block A; a second sequence
    computes [0, 1] again in its own block B (a stand-in for A) and then [0, 0] in block C,
    chained behind A. When the pool evicts A, B takes over the hash of [0, 1], and C, whose KV is
    still right, must stay reachable: the same 5 tokens then hit 2 full blocks (4 tokens)."""
    bm = BlockManager(7, 2, True)
    bm.allocate(0, [0, 1]); bm.mark_computed(0, 2); bm.free(0)          # A, freed but cached
    bm.allocate(1, [0, 1]); bm.mark_computed(1, 2)                      # B: the same KV as A
    bm.append_tokens(1, [0, 0, 0]); bm.mark_computed(1, 5)              # C behind [0, 1]
    bm.allocate(3, [0]); bm.allocate(4, [0, 0, 0, 0, 0])                # 7 blocks: A is evicted
    assert bm.stats["evicted_blocks"] == 1
    toks = bm.token_ids(1)
    bm.free(1)
    assert bm.allocate(5, toks) == 4


def test_a_live_chain_goes_on_through_the_stand_in_that_takes_over():
    """b computes the same first block as a (a stand-in). When a's copy is evicted, b's chain must
    go on through b's own copy, so the next block b computes is found behind it."""
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 9])                    # blocks [0, 1]
    bm.allocate("b", [1, 2, 3, 4, 5])              # blocks [2, 3, 4]: nothing computed yet
    bm.mark_computed("a", 2)
    bm.mark_computed("b", 2)                       # block 2 holds the same KV as block 0
    bm.free("a")
    bm.allocate("c", [7, 8, 9])                    # takes block 1, then evicts block 0
    assert not bm.is_cached(0) and bm.is_cached(2)
    bm.mark_computed("b", 4)
    assert bm.num_cached_tokens([1, 2, 3, 4, 6]) == 4
