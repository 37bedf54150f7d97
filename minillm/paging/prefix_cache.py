"""Prefix caching's index: which physical blocks hold the KV of which full blocks of tokens.

Letters: P block size.

Mixed into `BlockManager` (which owns the pool, refcounts and the LRU of freed blocks). Once a
full block's KV is written (`mark_computed`), it is registered under a hash chained over its
parent's hash and its tokens; a new prompt whose leading blocks hash the same reuses them. A hit
also checks the tokens and the parent block, so a collision never hands out wrong KV. Freed
cached blocks stay findable until the pool runs short (least recently freed evicted first). At
most `len(prompt) - 1` tokens count as cached, so the prefill always has a query. A block
computed while another caches the same KV is a stand-in that takes over when the owner leaves
(re-parenting the chains behind it); an orphan gives its hash up to the same block recomputed.

Left out on purpose: extra hash inputs (LoRA id, images, cache salt) and sharing across engines.
"""
from dataclasses import dataclass

from minillm.paging.host_tier import TokenNode


@dataclass(frozen=True)
class _CacheEntry:
    hash: int
    tokens: tuple[int, ...]
    parent: tuple[int, int] | None        # identity (block id, generation) of the parent block
    node: TokenNode | None = None         # the whole token prefix (what the host tier checks)


class PrefixCache:
    """The hash index, as a mixin: needs the host's `_ref`, `_free`, `_evictable`, `block_size`
    and `enable_prefix_caching`."""

    def _init_prefix_cache(self, num_blocks: int) -> None:
        self._gen = [0] * num_blocks               # bumped when a block's cached identity is dropped
        self._entry: dict[int, _CacheEntry] = {}   # block id -> what it caches
        self._by_hash: dict[int, int] = {}         # chained hash -> block id (the owner)
        self._dups: dict[int, list[int]] = {}      # hash -> other blocks with the owner's KV

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._entry)

    def block_hash(self, parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        """Chained hash of a full block: depends on every token before it through parent_hash
        (None for the first block). A tuple of ints hashes the same in every process."""
        return hash((-1 if parent_hash is None else parent_hash, tokens))

    def is_cached(self, block_id: int) -> bool:
        """True when the block is registered in the prefix cache."""
        return block_id in self._entry

    def _uncache(self, b: int) -> None:
        entry = self._entry.pop(b, None)
        if entry is not None:
            dups = self._dups.get(entry.hash, [])
            if self._by_hash.get(entry.hash) == b:
                del self._by_hash[entry.hash]
                if dups:                   # a copy of the same KV takes over the hash
                    heir = dups.pop(0)
                    self._by_hash[entry.hash] = heir
                    self._reparent((b, self._gen[b]), (heir, self._gen[heir]))
            elif b in dups:
                dups.remove(b)
            if not dups:
                self._dups.pop(entry.hash, None)
        self._gen[b] += 1  # blocks cached behind this one can no longer chain to it

    def _reparent(self, old: tuple[int, int], new: tuple[int, int]) -> None:
        """The block with identity `old` leaves the cache and `new`, holding the same KV, takes
        over its hash: blocks cached behind `old`, and the chains of live sequences that went
        through it, now go through `new` (their KV is still right: it depends on tokens only)."""
        for blk, e in list(self._entry.items()):
            if e.parent == old:
                self._entry[blk] = _CacheEntry(e.hash, e.tokens, new, e.node)
        for seq in getattr(self, "_seqs", {}).values():
            seq.chain = [(h, new if ident == old else ident) for h, ident in seq.chain]

    def _is_orphan(self, b: int) -> bool:
        """A cached block whose parent block has since left the cache: no chain reaches it."""
        parent = self._entry[b].parent
        return parent is not None and self._gen[parent[0]] != parent[1]

    def _register(self, b: int, h: int, toks: tuple, parent_id) -> tuple[int, int] | None:
        """Cache block b's KV (full, computed, tokens `toks` after `parent_id`) under hash h.
        Returns the identity the sequence's chain continues with, or None for a collision."""
        node = self._prefix_node(toks, parent_id)
        owner = self._by_hash.get(h)
        if owner is not None and owner != b and self._is_orphan(owner):
            self._uncache(owner)           # unreachable: let the new block own the hash
            if self._ref[owner] == 0:
                del self._evictable[owner]
                self._free.append(owner)
            owner = self._by_hash.get(h)   # a duplicate of the orphan may have taken over
        if owner is None or owner == b:
            if b in self._entry and owner != b:   # a stale entry from before a truncate
                self._uncache(b)
            self._entry[b] = _CacheEntry(h, toks, parent_id, node)
            self._by_hash[h] = b
            return b, self._gen[b]
        entry = self._entry[owner]
        if entry.tokens != toks or entry.parent != parent_id:
            return None                    # a hash collision: never chain through it
        if b in self._entry and self._entry[b].hash != h:
            self._uncache(b)               # a stale entry from before a truncate
        if b not in self._entry:           # same KV as the owner: kept as a stand-in
            self._entry[b] = _CacheEntry(h, toks, parent_id, node)
            self._dups.setdefault(h, []).append(b)
        return owner, self._gen[owner]

    def _prefix_node(self, toks: tuple, parent_id) -> TokenNode | None:
        """The token prefix of a block with tokens `toks` after the block `parent_id`, or None
        when the parent has left the cache (its prefix is no longer known here)."""
        if parent_id is None:
            return TokenNode(toks, None)
        parent = self._entry.get(parent_id[0])
        if parent is None or self._gen[parent_id[0]] != parent_id[1] or parent.node is None:
            return None
        return TokenNode(toks, parent.node)

    def _lookup(self, tokens: list[int]) -> list[tuple[int, int]]:
        """Cached blocks the prompt can reuse, as (block id, hash); at most (len - 1) // P."""
        hits, P = [], self.block_size
        if not self.enable_prefix_caching:
            return hits
        parent_hash, parent_id = None, None
        for i in range((len(tokens) - 1) // P):
            toks = tuple(tokens[i * P:(i + 1) * P])
            h = self.block_hash(parent_hash, toks)
            entry = self._entry.get(self._by_hash.get(h, -1))
            if entry is None or entry.tokens != toks or entry.parent != parent_id:
                break
            b = self._by_hash[h]
            hits.append((b, h))
            parent_hash, parent_id = h, (b, self._gen[b])
        return hits
