"""Host KV tier bookkeeping tests (minillm/paging/host_tier.py, offload.py).

The trusted reference is the emulated KV memory of test_block_manager.py, grown a host half:
every device slot and every host slot holds the token prefix whose KV was written there, and the
emulated runner makes the booked copies in the real runner's order (offloads, copy-on-write
copies, restores) only when a step runs. A restore from a slot that was overwritten, an offload
that read a block already reused, or a hit on a colliding hash shows up as a slot whose content
differs from the sequence's own prefix, or a host slot that differs from the prefix it is said
to hold.
"""
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from minillm.paging.block_manager import BlockManager
from minillm.paging.host_tier import HostTier, same_chain, spells
from minillm.paging.prefix_cache import TokenNode
from test_block_manager import MANAGERS, Machine, check_free_lists, tokens_st


class TierMachine(Machine):
    """test_block_manager's machine with a host tier and copies deferred to 'steps'."""

    @initialize(P=st.integers(1, 4), N=st.integers(1, 12), H=st.integers(1, 6),
                kind=st.sampled_from(sorted(MANAGERS)))
    def setup(self, P, N, H, kind):
        self.bm = MANAGERS[kind](N, P, True, HostTier(H))
        self.kv, self.host, self.next_id = {}, {}, 0
        self.uncached, self.computed, self.cow = 0, {}, []
        self.now = 0.0
        real = self.bm.prefix_cache.uncache

        def counted(b, seqs):
            self.uncached += 1
            real(b, seqs)
        self.bm.prefix_cache.uncache = counted

    def _run_moves(self):
        """The runner's block moves of one step, in its order."""
        P = self.bm.block_size
        offloads, restores = self.bm.take_kv_moves()
        for b, s in offloads:
            for o in range(P):
                self.host[s * P + o] = self.kv.get(b * P + o)
        for src, dst in self.cow:
            for o in range(P):
                if src * P + o in self.kv:
                    self.kv[dst * P + o] = self.kv[src * P + o]
        self.cow = []
        for s, b in restores:
            for o in range(P):
                self.kv[b * P + o] = self.host.get(s * P + o)

    def _write(self, s):
        self._run_moves()        # a forward pass comes after the step's moves
        super()._write(s)

    @precondition(lambda self: self.seqs())
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new):
        bm = self.bm
        s = data.draw(st.sampled_from(self.seqs()))
        self._write(s)
        if bm.can_append(s, len(new)):
            self.cow += bm.append_tokens(s, new)    # copied when the step runs
            if data.draw(st.booleans()):
                self._write(s)

    @rule(data=st.data(), prompt=st.lists(st.integers(0, 2), min_size=3, max_size=14),
          filler=st.lists(tokens_st, min_size=1, max_size=3))
    def come_back_after_pressure(self, data, prompt, filler):
        """A prompt is computed and freed, other prompts push it out of the device pool, and it
        comes back: the case the tier is for (restores, often several in one step)."""
        bm = self.bm
        for s in self.seqs():                      # make room: live prompts hold the pool
            if data.draw(st.booleans()):
                bm.free(s)
        for toks in [prompt] + filler:
            if bm.blocks_needed(len(toks)) <= bm.num_blocks and bm.can_allocate(toks):
                bm.allocate(self.next_id, toks)
                if data.draw(st.booleans()):
                    self._write(self.next_id)
                bm.free(self.next_id)
                self.next_id += 1
        if bm.blocks_needed(len(prompt)) <= bm.num_blocks and bm.can_allocate(prompt):
            bm.allocate(self.next_id, prompt)
            self.next_id += 1
            self._run_moves()                      # the step: restored KV is checked now

    @rule(dt=st.floats(0, 3), idle_s=st.floats(0, 2))
    def idle(self, dt, idle_s):
        self.now += dt
        self.bm.offload_idle(self.now, idle_s)

    @rule()
    def step(self):
        self._run_moves()

    @invariant()
    def computed_kv_is_the_sequences_own(self):
        bm, P = self.bm, self.bm.block_size
        pending = set(bm.offload._restores) | {dst for _, dst in self.cow}     # copies not made yet
        for s in bm.seq_ids():
            toks, table = bm.token_ids(s), bm.block_table(s)
            for p in range(bm.num_computed_tokens(s)):
                if table[p // P] not in pending:
                    assert self.kv.get(table[p // P] * P + p % P) == tuple(toks[:p + 1]), (s, p)

    @invariant()
    def host_slots_hold_what_the_tier_says(self):
        bm, P = self.bm, self.bm.block_size
        pending = {s for _, s in bm.offload._offloads}
        for entry in bm.host_tier._lru.values():
            if entry.slot in pending:
                continue
            prefix, node = [], entry.node
            while node is not None:
                prefix[:0] = node.tokens
                node = node.parent
            for o in range(P):
                assert self.host.get(entry.slot * P + o) == tuple(prefix[:len(prefix) - P + o + 1])

    def teardown(self):
        if hasattr(self, "bm"):
            self._run_moves()
        super().teardown()


TierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestTierOperations = TierMachine.TestCase


# ---- worked examples ---------------------------------------------------------------------------
def test_evicted_block_goes_to_the_host_and_comes_back():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True, host_tier=HostTier(4))
    bm.allocate("a", [1, 2, 3])                    # blocks [0, 1]
    bm.mark_computed("a", 3)                       # block 0 = (1, 2) is cached
    bm.free("a")
    assert bm.num_evictable_blocks == 1
    bm.allocate("b", [7, 8, 9])                    # needs both blocks: evicts block 0
    assert bm.take_kv_moves() == ([(0, 0)], [])    # device block 0 -> host slot 0
    bm.free("b")
    assert bm.num_cached_tokens([1, 2, 5]) == 2    # the device missed, the host hits
    assert bm.allocate("c", [1, 2, 5]) == 2
    offloads, restores = bm.take_kv_moves()
    assert restores == [(0, bm.block_table("c")[0])]
    assert bm.host_tier.stats == {"stored_blocks": 1, "restored_blocks": 1, "evicted_blocks": 0,
                                  "idle_offloaded_blocks": 0}


def test_idle_blocks_are_copied_and_stay_on_the_device():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True, host_tier=HostTier(4))
    bm.offload_idle(10.0, 2.0)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.mark_computed("a", 5)
    bm.free("a")                                   # idle since 10.0
    assert bm.offload_idle(11.5, 2.0) == 0
    assert bm.offload_idle(12.0, 2.0) == 2         # blocks (1, 2) and (3, 4)
    assert bm.take_kv_moves()[0] == [(1, 0), (0, 1)]   # freed tail first
    assert bm.num_evictable_blocks == 2 and bm.num_cached_tokens([1, 2, 3, 4, 9]) == 4
    assert bm.host_tier.stats["idle_offloaded_blocks"] == 2


def test_a_colliding_hash_is_never_restored():
    class Colliding(BlockManager):
        def block_hash(self, parent_hash, tokens):
            return 0
    bm = Colliding(num_blocks=2, block_size=2, enable_prefix_caching=True, host_tier=HostTier(2))
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    bm.free("a")
    bm.allocate("b", [4, 5, 6])                    # evicts (1, 2) into the host
    bm.free("b")
    assert bm.num_cached_tokens([4, 5, 6]) == 0    # same hash, other tokens: no hit
    assert bm.num_cached_tokens([1, 2, 6]) == 2


def test_pinned_slots_survive_stores_in_the_same_step():
    tier = HostTier(1)
    a, b = TokenNode((1,), None), TokenNode((2,), None)
    assert tier.store(1, a) == 0
    tier.pin(0)
    assert tier.store(2, b) is None                # the only slot waits for a restore
    tier.unpin_all()
    assert tier.store(2, b) == 0 and tier.stats["evicted_blocks"] == 1


def test_token_chains():
    a = TokenNode((1, 2), None)
    b, b2 = TokenNode((3, 4), a), TokenNode((3, 4), TokenNode((1, 2), None))
    assert same_chain(b, b2) and not same_chain(b, a)
    assert spells(b, [1, 2, 3, 4, 5], 2, 2) and not spells(b, [1, 9, 3, 4], 2, 2)


def test_a_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockManager(4, 2, enable_prefix_caching=False, host_tier=HostTier(2))
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier(0)


def test_a_slot_waiting_for_its_restore_is_not_overwritten():
    """P = 1, a 3-block pool and a 1-slot tier: the prompt hits the host, and taking its fresh
    blocks evicts a device block the full tier cannot take without overwriting that slot."""
    bm = BlockManager(3, 1, True, HostTier(1))
    bm.allocate("a", [1, 9])
    bm.mark_computed("a", 2)
    bm.free("a")
    bm.allocate("b", [5, 6, 4])                    # evicts (1, 9) then (1): the slot keeps (1)
    bm.take_kv_moves()
    bm.mark_computed("b", 3)
    bm.free("b")
    assert bm.allocate("c", [1, 7, 8]) == 1        # (1) from the host
    offloads, restores = bm.take_kv_moves()
    assert restores == [(0, bm.block_table("c")[0])] and offloads == []


def _restoring(compute_b: bool) -> BlockManager:
    """A 2-block pool whose prompt "c" = [1, 2, 7] is just allocated with (1, 2) restored from the
    host; with `compute_b`, (4, 5) of the prompt before it is cached and offloaded meanwhile."""
    bm = BlockManager(2, 2, True, HostTier(2))
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    bm.free("a")
    bm.allocate("b", [4, 5, 6])                    # (1, 2) goes to the host
    bm.take_kv_moves()
    if compute_b:
        bm.mark_computed("b", 3)
    bm.free("b")
    assert bm.allocate("c", [1, 2, 7]) == 2
    return bm


def test_a_restore_into_a_freed_block_is_cancelled():
    bm = _restoring(compute_b=False)
    target = bm.block_table("c")[0]
    bm.mark_computed("c", 2)                       # as a swap-in registers its blocks at once
    assert bm.is_cached(target)
    bm.free("c")                                   # preempted before the step ran
    assert bm.take_kv_moves() == ([], [])          # no restore into a free block
    assert not bm.is_cached(target)                # and its never-written KV is not findable


def test_a_failed_step_forgets_the_copies_it_was_handed():
    bm = _restoring(compute_b=True)                # restores (1, 2), offloads (4, 5)
    target = bm.block_table("c")[0]
    moves = bm.take_kv_moves()                     # handed to a step that fails
    assert moves[0] and moves[1]
    bm.mark_computed("c", 2)                       # as a swap-in registers its blocks at once
    bm.free("c")
    bm.forget_moves(*moves)
    assert not bm.is_cached(target)                # its restore may never have been made
    assert bm.num_cached_tokens([4, 5, 6]) == 0    # nor the offload: the host slot is dropped
    check_free_lists(bm)
