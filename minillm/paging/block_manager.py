"""Paged KV-cache bookkeeping: which physical block holds which tokens of which sequence.

Letters: N physical blocks in the pool, P block size (token slots per block).

No tensors here (the KV lives in paged_cache.py): only block ids. Each sequence owns a *block
table*, logical block i (positions i*P .. i*P+P-1) -> physical block id, so position `pos` lives
in slot `table[pos // P] * P + pos % P`. Blocks are shared by reference count: `fork` shares every
block, and the first write into a shared, partly filled last block copies it. The manager owns
`prefix_cache` (prefix_cache.py) and, with a host tier, `offload` (offload.py: the copies to and
from it, handed out by `take_kv_moves`); without one, `offload` is None and no call leaves here.

Left out on purpose: swapping (the scheduler's, through the runner), sliding-window tables, and
any policy: the manager answers "can I?" and raises `NoFreeBlocksError` before changing anything.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from minillm._validate import check_int, check_token_ids as _check_tokens
from minillm.paging.host_tier import HostTier
from minillm.paging.offload import OffloadManager
from minillm.paging.prefix_cache import PrefixCache


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for. Raised before any state changes."""


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int]                      # logical block -> physical block id
    num_computed: int = 0                 # tokens whose KV is written
    chain: list = field(default_factory=list)  # per full computed block: (hash, identity or None)


class BlockManager:
    """A pool of `num_blocks` blocks of `block_size` tokens, with block tables, reference
    counts, fork + copy-on-write and (optionally) prefix caching.

    >>> bm = BlockManager(num_blocks=8, block_size=4)
    >>> bm.allocate("a", [1, 2, 3, 4, 5, 6])       # 6 tokens -> 2 blocks; nothing cached
    0
    >>> bm.block_table("a"), bm.num_free_blocks
    ([0, 1], 6)
    >>> bm.fork("a", "b"); bm.ref_count(1)
    2
    >>> bm.append_tokens("b", [7])                  # b writes into shared block 1: copy first
    [(1, 2)]
    >>> bm.block_table("b"), bm.ref_count(1)
    ([0, 2], 1)
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 host_tier: HostTier | None = None):
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref = [0] * num_blocks
        self._free = deque(range(num_blocks))  # refcount 0, nothing cached in it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached; LRU first
        self._seqs: dict = {}
        self.prefix_cache = PrefixCache(num_blocks, block_size, self.block_hash,
                                        self.enable_prefix_caching)
        self.host_tier = host_tier            # a second KV tier in host memory, or None
        self.offload = (None if host_tier is None else
                        OffloadManager(host_tier, self.prefix_cache, self.enable_prefix_caching))
        # queried_blocks: prompt blocks that could have hit ((len - 1) // P per prompt, with caching)
        self.stats = {"queried_blocks": 0, "hit_blocks": 0, "evicted_blocks": 0, "cow_copies": 0}

    # ---- pool state -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request could get: free ones plus evictable cached ones (refcount 0)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks with refcount 0: free to take, and still findable until taken."""
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self.prefix_cache)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / P)."""
        return -(-check_int("num_tokens", num_tokens, 0) // self.block_size)

    def ref_count(self, block_id: int) -> int:
        check_int("block_id", block_id, 0)
        if block_id >= self.num_blocks:
            raise ValueError(f"block_id must be < num_blocks={self.num_blocks}, got {block_id}")
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """True when the block is registered in the prefix cache."""
        return block_id in self.prefix_cache

    def block_hash(self, parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        """Chained hash of a full block: depends on every token before it through parent_hash
        (None for the first block). A tuple of ints hashes the same in every process."""
        return hash((-1 if parent_hash is None else parent_hash, tokens))

    def free_block_ids(self) -> list[int]:
        """Ids of blocks with refcount 0: the free list, then evictable cached blocks (LRU first)."""
        return list(self._free) + list(self._evictable)

    # ---- per-sequence queries -----------------------------------------------------------
    def _get(self, seq_id) -> _Seq:
        if seq_id not in self._seqs:
            raise KeyError(f"unknown seq_id {seq_id!r}: never allocated or already freed")
        return self._seqs[seq_id]

    def seq_ids(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        """`seq_id in bm`: whether the sequence holds blocks now (a dict lookup, not a list scan)."""
        return seq_id in self._seqs

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id) -> int:
        return len(self._get(seq_id).tokens)

    def token_ids(self, seq_id) -> list[int]:
        return list(self._get(seq_id).tokens)

    def num_computed_tokens(self, seq_id) -> int:
        return self._get(seq_id).num_computed

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """Physical slots of token positions start..end-1 (where their KV is written/read)."""
        seq, P = self._get(seq_id), self.block_size
        if not 0 <= start <= end <= len(seq.tokens):
            raise ValueError(f"need 0 <= start <= end <= num_tokens={len(seq.tokens)}, "
                             f"got start={start}, end={end}")
        return [seq.table[p // P] * P + p % P for p in range(start, end)]

    # ---- block pool internals -------------------------------------------------------------
    def _take_free(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:  # evict the least recently freed cached block
            b, _ = self._evictable.popitem(last=False)
            if self.offload:
                self.offload.evicted(b)   # its KV is copied to the host tier first
            self.prefix_cache.uncache(b, self._seqs.values())
            self.stats["evicted_blocks"] += 1
        self._ref[b] = 1
        return b

    def _incref(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._evictable[b]  # only cached blocks are found with refcount 0
        self._ref[b] += 1

    def _decref(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if self.offload and self.offload.cancel_restore(b) and b in self.prefix_cache:
                self.prefix_cache.uncache(b, self._seqs.values())  # its KV was never written
            if b in self.prefix_cache:
                self._evictable[b] = None  # newest at the end
                if self.offload:
                    self.offload.start_idle_clock(b)
            else:
                self._free.append(b)

    def _release(self, b: int) -> None:
        """b has just left the prefix cache: if it was evictable, it is free now."""
        if b in self._evictable:
            del self._evictable[b]
            self._free.append(b)

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens `allocate` would find in the prefix cache now. A pure probe:
        it changes no block, no LRU order and no statistic. Host-tier hits count too."""
        tokens = _check_tokens(token_ids)
        hits = self.prefix_cache.lookup(tokens)
        return (len(hits) + len(self._host_hits(tokens, hits))) * self.block_size

    def _host_hits(self, tokens: list[int], hits: list) -> list:
        return self.offload.hits(tokens, hits) if self.offload else []  # the chain goes on there

    # ---- operations -------------------------------------------------------------------
    def _plan(self, token_ids: list[int], use_cache: bool = True) -> tuple[list, list, int, int]:
        """(tokens, prefix-cache hits (none unless use_cache), new blocks needed, blocks free for
        them): revived hits need no new block but leave the free count."""
        tokens = _check_tokens(token_ids)
        need = self.blocks_needed(len(tokens))
        if need > self.num_blocks:
            raise ValueError(f"a request of {len(tokens)} tokens needs {need} blocks of "
                             f"block_size={self.block_size}, but the pool has only "
                             f"num_blocks={self.num_blocks}")
        hits = self.prefix_cache.lookup(tokens) if use_cache else []
        revived = sum(self._ref[b] == 0 for b, _ in hits)  # hits that leave the evictable pool
        return tokens, hits, need - len(hits), self.num_free_blocks - revived

    def can_allocate(self, token_ids: list[int], use_cache: bool = True) -> bool:
        """Whether `allocate` would succeed now (prefix-cache hits need no new block).
        A prompt that could never fit in the whole pool raises ValueError instead."""
        _, _, new, free = self._plan(token_ids, use_cache)
        return new <= free

    def allocate(self, seq_id, token_ids: list[int], use_cache: bool = True) -> int:
        """Give a new sequence blocks for all its tokens; return how many leading prompt tokens have
        their KV cached (a multiple of P; host-tier restores included; none unless use_cache)."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        tokens, hits, new, free = self._plan(token_ids, use_cache)
        if new > free:
            raise NoFreeBlocksError(f"seq {seq_id!r} needs {new} new blocks, {free} free")
        host = self._host_hits(tokens, hits) if use_cache else []
        for b, _ in hits:  # take the hits first so that _take_free cannot evict them
            self._incref(b)
        table = [b for b, _ in hits]
        if host:
            self.offload.pin(host)
        table += [self._take_free() for _ in range(new)]
        if host:
            self.offload.book_restores(table[len(hits):], host)
        chain = [(h, self.prefix_cache.identity(b)) for b, h in hits]
        num_cached = (len(hits) + len(host)) * self.block_size
        self._seqs[seq_id] = _Seq(tokens, table, num_cached, chain)
        if self.enable_prefix_caching and use_cache:
            self.stats["queried_blocks"] += (len(tokens) - 1) // self.block_size
            self.stats["hit_blocks"] += len(hits)
        return num_cached

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is written. With prefix caching, the
        full blocks among them become cache entries. A smaller number than before is ignored."""
        seq = self._get(seq_id)
        check_int("num_computed_tokens", num_computed_tokens, 0, len(seq.tokens))
        seq.num_computed = max(seq.num_computed, num_computed_tokens)
        full = seq.num_computed // self.block_size
        for orphan in self.prefix_cache.extend_chain(seq, full, self._seqs.values()):
            self._release(orphan)     # it left the cache: if idle, it is plainly free now

    def _append_cost(self, seq: _Seq, num_new: int) -> tuple[int, bool]:
        n_old, P = len(seq.tokens), self.block_size
        cow = num_new > 0 and n_old % P != 0 and self._ref[seq.table[-1]] > 1
        return self.blocks_needed(n_old + num_new) - len(seq.table) + cow, cow

    def can_append(self, seq_id, num_new: int = 1) -> bool:
        check_int("num_new", num_new, 0)
        need, _ = self._append_cost(self._get(seq_id), num_new)
        return need <= self.num_free_blocks

    def append_tokens(self, seq_id, token_ids: list[int]) -> list[tuple[int, int]]:
        """Grow the sequence by `token_ids` (their KV is written next). Returns copy-on-write
        instructions (src_block, dst_block) to execute BEFORE writing that KV."""
        seq, toks = self._get(seq_id), _check_tokens(token_ids, allow_empty=True)
        need, cow = self._append_cost(seq, len(toks))
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"seq {seq_id!r} needs {need} new blocks to append "
                                    f"{len(toks)} tokens, {self.num_free_blocks} free")
        copies = []
        if toks and len(seq.tokens) % self.block_size:
            last = seq.table[-1]
            if cow:  # shared and partly filled: write into a private copy
                dst = self._take_free()
                self._decref(last)
                seq.table[-1] = dst
                copies.append((last, dst))
                self.stats["cow_copies"] += 1
            elif last in self.prefix_cache:  # we own it, but its cached KV is about to be overwritten
                self.prefix_cache.uncache(last, self._seqs.values())
        seq.tokens.extend(toks)
        while len(seq.table) < self.blocks_needed(len(seq.tokens)):
            seq.table.append(self._take_free())
        return copies

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Roll the sequence back to its first `num_tokens` tokens (rejected speculative tokens)."""
        seq = self._get(seq_id)
        check_int("num_tokens", num_tokens, 0, len(seq.tokens))
        keep = self.blocks_needed(num_tokens)
        for b in reversed(seq.table[keep:]):
            self._decref(b)
        del seq.table[keep:], seq.tokens[num_tokens:], seq.chain[num_tokens // self.block_size:]
        seq.num_computed = min(seq.num_computed, num_tokens)

    def replace_tokens(self, seq_id, start: int, token_ids: list[int]) -> None:
        """Overwrite the tokens at positions start.. with `token_ids`, keeping every block: after a
        token tree's verify the accepted path's tokens take the places its nodes were booked in
        (their KV is moved there too, `PagedKVCache.move_slots`). Only tokens not yet computed
        (so never hashed into the prefix cache) may change."""
        seq, toks = self._get(seq_id), _check_tokens(token_ids, allow_empty=True)
        check_int("start", start, seq.num_computed)
        if start + len(toks) > len(seq.tokens):
            raise ValueError(f"start + len(token_ids) must be <= num_tokens={len(seq.tokens)}, "
                             f"got {start} + {len(toks)}")
        seq.tokens[start:start + len(toks)] = toks

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent. Fork after the parent's KV is written
        (e.g. right after prefill) and before either side appends its own next token."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id!r} is already allocated")
        for b in parent.table:
            self._incref(b)
        self._seqs[child_id] = _Seq(list(parent.tokens), list(parent.table),
                                    parent.num_computed, list(parent.chain))

    def free(self, seq_id) -> None:
        """Release a sequence's blocks; tail blocks first, so they are evicted before the prefix."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for b in reversed(seq.table):
            self._decref(b)

    # ---- the host tier's copies (offload.py) ----------------------------------------------
    def offload_idle(self, now: float, idle_s: float) -> int:
        """Book cached blocks idle `idle_s` or longer into the host tier; returns how many."""
        return self.offload.offload_idle(now, idle_s, self._evictable) if self.offload else 0

    def has_pending_restores(self, seq_id) -> bool:
        """Whether some block of the sequence still waits for its restore (made this step)."""
        return bool(self.offload) and self.offload.pending_restore(self._get(seq_id).table)

    def take_kv_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies booked since the last call: offloads, restores (`OffloadManager.take_moves`)."""
        return self.offload.take_moves() if self.offload else ([], [])

    def forget_moves(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """A step failed after its copies were handed out, so they may not have been made: the
        offloads' host slots and the restores' device blocks lose what they were said to hold."""
        if self.offload:
            self.offload.forget_offloads(offloads)
        for _, b in restores:
            if b in self.prefix_cache:
                self.prefix_cache.uncache(b, self._seqs.values())
                self._release(b)
