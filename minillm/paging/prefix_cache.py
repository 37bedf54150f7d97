"""Prefix caching's index: which physical blocks hold the KV of which full blocks of tokens.

Letters: P block size.

An object the `BlockManager` owns: the manager keeps the pool (refcounts, free list, the LRU of
freed blocks), this keeps only the index. Once a full block's KV is written (`mark_computed`), it
is registered under a hash chained over its parent's hash and its tokens; a new prompt whose
leading blocks hash the same reuses them. A hit also checks the tokens and the parent block, so a
collision never hands out wrong KV. At most `len(prompt) - 1` tokens count as cached, so the
prefill always has a query. A block computed while another caches the same KV is a stand-in that
takes over when the owner leaves (re-parenting the chains behind it); an orphan (its parent left
the cache) gives its hash up to the same block recomputed.

Left out on purpose: extra hash inputs (LoRA id, images, cache salt) and sharing across engines.
"""
from dataclasses import dataclass


class TokenNode:
    """One full block's tokens and the node of the block before it (None for the first block):
    following `parent` spells out the whole token prefix whose KV the block holds."""

    __slots__ = ("tokens", "parent")

    def __init__(self, tokens: tuple[int, ...], parent: "TokenNode | None"):
        self.tokens, self.parent = tokens, parent


@dataclass(frozen=True)
class CacheEntry:
    hash: int
    tokens: tuple[int, ...]
    parent: tuple[int, int] | None        # identity (block id, generation) of the parent block
    node: TokenNode | None = None         # the whole token prefix (what the host tier checks)


class PrefixCache:
    """The hash index over a pool of `num_blocks` blocks of `block_size` tokens. `block_hash` is
    the owner's chained hash function (a test subclass of the manager makes it collide). When
    not `enabled`, nothing is ever found or registered.

    A block's *identity* is (block id, generation): the generation is bumped whenever the block
    leaves the cache, so a chain that went through its old contents can no longer continue.
    `seqs` arguments are the owner's live sequences (each with a `.chain` of (hash, identity))."""

    def __init__(self, num_blocks: int, block_size: int, block_hash, enabled: bool = True):
        self.block_size, self.block_hash, self.enabled = block_size, block_hash, enabled
        self._gen = [0] * num_blocks               # bumped when a block's cached identity is dropped
        self._entry: dict[int, CacheEntry] = {}    # block id -> what it caches
        self._by_hash: dict[int, int] = {}         # chained hash -> block id (the owner)
        self._dups: dict[int, list[int]] = {}      # hash -> other blocks with the owner's KV

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, b: int) -> bool:
        return b in self._entry

    def entry(self, b: int) -> CacheEntry | None:
        return self._entry.get(b)

    def identity(self, b: int) -> tuple[int, int]:
        return b, self._gen[b]

    def lookup(self, tokens: list[int]) -> list[tuple[int, int]]:
        """Cached blocks the prompt can reuse, as (block id, hash); at most (len - 1) // P."""
        hits, P = [], self.block_size
        parent_hash, parent_id = None, None
        for i in range((len(tokens) - 1) // P if self.enabled else 0):
            toks = tuple(tokens[i * P:(i + 1) * P])
            h = self.block_hash(parent_hash, toks)
            entry = self._entry.get(self._by_hash.get(h, -1))
            if entry is None or entry.tokens != toks or entry.parent != parent_id:
                break
            b = self._by_hash[h]
            hits.append((b, h))
            parent_hash, parent_id = h, (b, self._gen[b])
        return hits

    def uncache(self, b: int, seqs) -> None:
        """Block b leaves the cache (if it was in it); a stand-in with the same KV takes over."""
        entry = self._entry.pop(b, None)
        if entry is not None:
            dups = self._dups.get(entry.hash, [])
            if self._by_hash.get(entry.hash) == b:
                del self._by_hash[entry.hash]
                if dups:                   # a copy of the same KV takes over the hash
                    heir = dups.pop(0)
                    self._by_hash[entry.hash] = heir
                    self._reparent((b, self._gen[b]), (heir, self._gen[heir]), seqs)
            elif b in dups:
                dups.remove(b)
            if not dups:
                self._dups.pop(entry.hash, None)
        self._gen[b] += 1  # blocks cached behind this one can no longer chain to it

    def _reparent(self, old: tuple[int, int], new: tuple[int, int], seqs) -> None:
        """The block with identity `old` leaves the cache and `new`, holding the same KV, takes
        over its hash: blocks cached behind `old`, and the chains of live sequences that went
        through it, now go through `new` (their KV is still right: it depends on tokens only)."""
        for blk, e in list(self._entry.items()):
            if e.parent == old:
                self._entry[blk] = CacheEntry(e.hash, e.tokens, new, e.node)
        for seq in seqs:
            seq.chain = [(h, new if ident == old else ident) for h, ident in seq.chain]

    def _is_orphan(self, b: int) -> bool:
        """A cached block whose parent block has since left the cache: no chain reaches it."""
        parent = self._entry[b].parent
        return parent is not None and self._gen[parent[0]] != parent[1]

    def extend_chain(self, seq, num_full: int, seqs) -> list[int]:
        """Register the sequence's computed full blocks up to block `num_full` (`seq` has
        `.tokens`, `.table` and `.chain`). Returns the orphans that gave their hash up and left
        the cache (the pool frees those that are idle)."""
        P, orphans = self.block_size, []
        for i in range(len(seq.chain), num_full if self.enabled else 0):
            parent_hash, parent_id = seq.chain[-1] if seq.chain else (None, None)
            toks = tuple(seq.tokens[i * P:(i + 1) * P])
            h, ident = self.block_hash(parent_hash, toks), None
            if i == 0 or parent_id is not None:  # a broken chain is never registered
                ident, orphan = self._register(seq.table[i], h, toks, parent_id, seqs)
                orphans += [orphan] if orphan is not None else []
            seq.chain.append((h, ident))
        return orphans

    def _register(self, b: int, h: int, toks: tuple, parent_id, seqs):
        """Cache block b's KV (full, computed, tokens `toks` after `parent_id`) under hash h.
        Returns (the identity the sequence's chain continues with, or None for a collision;
        the orphan that gave hash h up, or None)."""
        node = self._prefix_node(toks, parent_id)
        owner, orphan = self._by_hash.get(h), None
        if owner is not None and owner != b and self._is_orphan(owner):
            orphan = owner
            self.uncache(orphan, seqs)     # unreachable: let the new block own the hash
            owner = self._by_hash.get(h)   # a stand-in of the orphan may have taken over
        if owner is None or owner == b:
            if b in self._entry and owner != b:   # a stale entry from before a truncate
                self.uncache(b, seqs)
            self._entry[b] = CacheEntry(h, toks, parent_id, node)
            self._by_hash[h] = b
            return (b, self._gen[b]), orphan
        entry = self._entry[owner]
        if entry.tokens != toks or entry.parent != parent_id:
            return None, orphan            # a hash collision: never chain through it
        if b in self._entry and self._entry[b].hash != h:
            self.uncache(b, seqs)          # a stale entry from before a truncate
        if b not in self._entry:           # same KV as the owner: kept as a stand-in
            self._entry[b] = CacheEntry(h, toks, parent_id, node)
            self._dups.setdefault(h, []).append(b)
        return (owner, self._gen[owner]), orphan

    def _prefix_node(self, toks: tuple, parent_id) -> TokenNode | None:
        """The token prefix of a block with tokens `toks` after the block `parent_id`, or None
        when the parent has left the cache (its prefix is no longer known here)."""
        if parent_id is None:
            return TokenNode(toks, None)
        parent = self._entry.get(parent_id[0])
        if parent is None or self._gen[parent_id[0]] != parent_id[1] or parent.node is None:
            return None
        return TokenNode(toks, parent.node)
