"""A second KV tier in host memory: the bookkeeping of its slots (no tensors here).

Letters: P block size, Nh host slots.

When the device pool evicts a freed prefix-cache block, or one sits idle longer than
`offload_idle_s`, its KV is copied to host memory (host_pool.py holds the tensors; offload.py
books the copies) instead of lost; a later prompt whose leading blocks miss the device cache
continues its chain here, each hit restored into a fresh device block and counted as cached.

Slots are keyed by the block's chained hash, but a hit is exact: each slot keeps its whole token
prefix as a chain of `TokenNode`s, compared with the prompt (shared nodes stop the walk early; a
hash collision is refused). Slots are evicted LRU when the tier is full, except *pinned* ones a
restore of the step being scheduled still has to read (`unpin_all` after each schedule).

Left out on purpose: a disk tier below this one, sharing the tier between engines (vLLM's
LMCache), compression of the host copies, and asynchronous copies overlapped with the forward.
"""
from collections import OrderedDict, deque
from dataclasses import dataclass

from minillm._validate import check_int
from minillm.paging.prefix_cache import TokenNode


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
