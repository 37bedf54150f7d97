"""Paged KV-cache bookkeeping: which physical block holds which tokens of which sequence.

Letters: N physical blocks in the pool, P block size (token slots per block).

No tensors here (the KV lives in paging/paged_cache.py): only block ids. Each sequence owns a
*block table*, logical block i (positions i*P .. i*P+P-1) -> physical block id, so position `pos`
lives in slot `table[pos // P] * P + pos % P`. Blocks are handed out one at a time on demand and
come back when the sequence is freed. Blocks are shared by reference count: `fork(parent,
child)` shares every block, and the first write into a shared, partly filled last block copies it
(`append_tokens` returns `(src, dst)` pairs the runner copies first). Prefix caching
(prefix_cache.py) and the host tier's bookkeeping (offload.py) are mixed in; the tier's copies are
handed out by `take_kv_moves` each step.

Left out on purpose: swapping whole sequences (the scheduler does that through the runner),
sliding-window or per-layer tables, extra hash inputs (LoRA id, images, cache salt), and any
scheduling policy: the manager only answers "can I?" and raises `NoFreeBlocksError` (before
changing anything) when it cannot.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from minillm._validate import check_int
from minillm.paging.host_tier import HostTier
from minillm.paging.offload import Offload
from minillm.paging.prefix_cache import PrefixCache


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for. Raised before any state changes."""


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int]                      # logical block -> physical block id
    num_computed: int = 0                 # tokens whose KV is written
    chain: list = field(default_factory=list)  # per full computed block: (hash, identity or None)


def _check_tokens(token_ids, allow_empty: bool = False) -> list[int]:
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    if not token_ids and not allow_empty:
        raise ValueError("token_ids must hold at least one token, got an empty list")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise TypeError("token_ids must be a list of ints")
    return list(token_ids)


class BlockManager(PrefixCache, Offload):
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
        self._init_prefix_cache(num_blocks)
        self._init_offload(host_tier)         # a second KV tier in host memory (offload.py)
        self._seqs: dict = {}
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

    def free_block_ids(self) -> list[int]:
        """Ids of blocks with refcount 0: the plain free list, then evictable cached blocks (LRU first)."""
        return list(self._free) + list(self._evictable)

    # ---- per-sequence queries -----------------------------------------------------------
    def _get(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq_id {seq_id!r}: never allocated or already freed") from None

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
            self._offload_evicted(b)   # with a host tier: its KV is copied there first
            self._uncache(b)
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
            if b in self._entry:
                self._evictable[b] = None  # newest at the end
            else:
                self._free.append(b)
            self._freed(b)

    def _check_fits(self, num_tokens: int) -> int:
        need = self.blocks_needed(num_tokens)
        if need > self.num_blocks:
            raise ValueError(f"a request of {num_tokens} tokens needs {need} blocks of "
                             f"block_size={self.block_size}, but the pool has only "
                             f"num_blocks={self.num_blocks}")
        return need

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens `allocate` would find in the prefix cache now. A pure probe:
        it changes no block, no LRU order and no statistic. Host-tier hits count too."""
        tokens = _check_tokens(token_ids)
        hits = self._lookup(tokens)
        return (len(hits) + len(self._host_hits(tokens, hits))) * self.block_size

    # ---- operations -------------------------------------------------------------------
    def can_allocate(self, token_ids: list[int]) -> bool:
        """Whether `allocate` would succeed now (prefix-cache hits need no new block).
        A prompt that could never fit in the whole pool raises ValueError instead."""
        tokens = _check_tokens(token_ids)
        need = self._check_fits(len(tokens))
        hits = self._lookup(tokens)
        revived = sum(self._ref[b] == 0 for b, _ in hits)  # hits that leave the evictable pool
        return self.num_free_blocks - revived >= need - len(hits)

    def allocate(self, seq_id, token_ids: list[int]) -> int:
        """Give a new sequence blocks for all its tokens; return how many leading prompt
        tokens already have their KV in the prefix cache (a multiple of P, <= len - 1). With a
        host tier that includes blocks restored from it (booked: see `take_kv_moves`)."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        tokens = _check_tokens(token_ids)
        need = self._check_fits(len(tokens))
        hits = self._lookup(tokens)
        revived = sum(self._ref[b] == 0 for b, _ in hits)
        if self.num_free_blocks - revived < need - len(hits):
            raise NoFreeBlocksError(f"seq {seq_id!r} needs {need - len(hits)} new blocks, "
                                    f"{self.num_free_blocks - revived} free")
        host = self._host_hits(tokens, hits)   # the chain goes on in the host tier (offload.py)
        for b, _ in hits:  # take the hits first so that _take_free cannot evict them
            self._incref(b)
        self._pin(host)
        table = [b for b, _ in hits] + [self._take_free() for _ in range(need - len(hits))]
        self._book_restores(table[len(hits):], host)
        chain = [(h, (b, self._gen[b])) for b, h in hits]
        num_cached = (len(hits) + len(host)) * self.block_size
        self._seqs[seq_id] = _Seq(tokens, table, num_cached, chain)
        if self.enable_prefix_caching:
            self.stats["queried_blocks"] += (len(tokens) - 1) // self.block_size
            self.stats["hit_blocks"] += len(hits)
        return num_cached

    def mark_computed(self, seq_id, num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is written. With prefix caching, the
        full blocks among them become cache entries. A smaller number than before is ignored."""
        seq, P = self._get(seq_id), self.block_size
        check_int("num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > len(seq.tokens):
            raise ValueError(f"num_computed_tokens must be <= num_tokens={len(seq.tokens)}, "
                             f"got {num_computed_tokens}")
        seq.num_computed = max(seq.num_computed, num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.chain), seq.num_computed // P):
            parent_hash, parent_id = seq.chain[-1] if seq.chain else (None, None)
            toks = tuple(seq.tokens[i * P:(i + 1) * P])
            h, ident = self.block_hash(parent_hash, toks), None
            if i == 0 or parent_id is not None:  # a broken chain is never registered
                ident = self._register(seq.table[i], h, toks, parent_id)
            seq.chain.append((h, ident))

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
            elif last in self._entry:  # we own it, but its cached KV is about to be overwritten
                self._uncache(last)
        seq.tokens.extend(toks)
        while len(seq.table) < self.blocks_needed(len(seq.tokens)):
            seq.table.append(self._take_free())
        return copies

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Roll the sequence back to its first `num_tokens` tokens (rejected speculative tokens)."""
        seq = self._get(seq_id)
        check_int("num_tokens", num_tokens, 0)
        if num_tokens > len(seq.tokens):
            raise ValueError(f"num_tokens must be <= num_tokens of the seq ({len(seq.tokens)}), "
                             f"got {num_tokens}")
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
