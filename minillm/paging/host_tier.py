"""A second KV tier in host memory: the bookkeeping of its slots (no tensors here).

Letters: P block size, Nh host slots.

The device pool (block_manager.py) keeps freed prefix-cache blocks findable until it runs short,
then evicts the least recently freed one and its KV is gone: the next prompt with that prefix
recomputes it. With a host tier the KV leaves for host memory instead (a copy per block, made by
the runner; paging/host_pool.py holds the tensors) and a later prompt whose leading blocks miss the
device cache continues its chain here: each hit gets a fresh device block and a host -> device
copy (a *restore*), and its tokens count as cached. Two ways in (both booked by the block
manager's offload mixin, paging/offload.py): a cached block evicted from the device pool, and a
cached block idle (refcount 0) longer than `offload_idle_s`.

Exactness. Slots are keyed by the block's chained hash, but a hash only finds a candidate: each
slot keeps the block's whole token prefix as a chain of `TokenNode`s (its own tokens -> its
parent block's node -> ... -> the first block), and a hit compares that chain with the prompt's
tokens. Consecutive blocks of one prompt usually share node objects, so the comparison stops at
the first shared node (one tuple compare per block); a hash collision costs a full walk and is
then refused, never handed out.

A slot holds what it was given until it is evicted (LRU when the tier is full). A slot that a
restore in the step being scheduled still has to read is *pinned*: no store may evict it before
the runner has made the copy (`unpin_all` at the end of each schedule).

Left out on purpose: a disk tier below this one, sharing the tier between engines (vLLM's
LMCache), compression of the host copies, and asynchronous copies overlapped with the forward.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass

from minillm._validate import check_int


class TokenNode:
    """One full block's tokens and the node of the block before it (None for the first block):
    following `parent` spells out the whole token prefix whose KV the block holds."""

    __slots__ = ("tokens", "parent")

    def __init__(self, tokens: tuple[int, ...], parent: "TokenNode | None"):
        self.tokens, self.parent = tokens, parent


def same_chain(a: TokenNode | None, b: TokenNode | None) -> bool:
    """Whether two nodes spell the same token prefix (stops at the first shared node)."""
    while a is not b:
        if a is None or b is None or a.tokens != b.tokens:
            return False
        a, b = a.parent, b.parent
    return True


def spells(node: TokenNode | None, tokens: list[int], num_blocks: int, P: int) -> bool:
    """Whether `node` spells exactly tokens[:num_blocks * P] (block by block, last first)."""
    for i in range(num_blocks - 1, -1, -1):
        if node is None or node.tokens != tuple(tokens[i * P:(i + 1) * P]):
            return False
        node = node.parent
    return node is None


@dataclass(frozen=True)
class HostEntry:
    slot: int
    node: TokenNode                       # the block's full token prefix


class HostTier:
    """`num_blocks` host slots, an LRU map from chained block hash to `HostEntry`, and counters.

    >>> tier = HostTier(num_blocks=2)
    >>> a = TokenNode((1, 2), None)
    >>> tier.store(hash(a.tokens), a), tier.store(hash(a.tokens), a)   # the second: already there
    (0, None)
    >>> tier.find(hash(a.tokens), [1, 2, 3], 0, 2, None).slot, tier.num_used
    (0, 1)
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self._free = deque(range(num_blocks))
        self._lru: OrderedDict[int, HostEntry] = OrderedDict()     # hash -> entry, LRU first
        self._pinned: set[int] = set()
        self.stats = {"stored_blocks": 0, "restored_blocks": 0, "evicted_blocks": 0,
                      "idle_offloaded_blocks": 0}

    @property
    def num_used(self) -> int:
        """Slots holding a block's KV."""
        return len(self._lru)

    def find(self, h: int, tokens: list[int], i: int, P: int, prev: TokenNode | None):
        """The entry holding block i of `tokens` (hash h), or None. `prev` is the node already
        verified for block i - 1 (None if unknown): then only block i's tokens are compared. A
        pure probe: the LRU order does not change."""
        entry = self._lru.get(h)
        if entry is None or entry.node.tokens != tuple(tokens[i * P:(i + 1) * P]):
            return None
        parent = entry.node.parent
        if i == 0:
            return entry if parent is None else None
        if prev is not None and parent is prev:
            return entry
        return entry if spells(parent, tokens, i, P) else None

    def touch(self, h: int) -> None:
        """A hit: the entry becomes the most recently used."""
        self._lru.move_to_end(h)

    def pin(self, slot: int) -> None:
        """A restore booked this step reads `slot`: no store may evict it before the copy."""
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def store(self, h: int, node: TokenNode) -> int | None:
        """Take the block with hash h and prefix `node`: the slot the runner must copy its KV
        into, or None when no copy is needed (already here) or possible (a different block holds
        this hash, or every slot is pinned)."""
        entry = self._lru.get(h)
        if entry is not None:
            if same_chain(entry.node, node):
                self._lru.move_to_end(h)
            return None               # the same KV is here already, or a collision: keep it
        if self._free:
            slot = self._free.popleft()
        else:
            victim = next((k for k, e in self._lru.items() if e.slot not in self._pinned), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim).slot
            self.stats["evicted_blocks"] += 1
        self._lru[h] = HostEntry(slot, node)
        self.stats["stored_blocks"] += 1
        return slot

    def discard(self, slot: int) -> None:
        """Forget what `slot` holds (a booked copy into it was never made)."""
        for k, e in self._lru.items():
            if e.slot == slot:
                del self._lru[k]
                self._free.append(slot)
                return
