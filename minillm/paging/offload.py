"""The block manager's side of the host tier: it books copies, the runner makes them.

`OffloadManager` is an object the `BlockManager` owns next to its `PrefixCache`; with no host
tier every method is a no-op. Nothing here touches a tensor: the scheduler collects the booked
copies (`take_moves`) and the runner makes them before anything else writes those blocks
(offloads, swaps and copy-on-write, restores, then the forward). Two ways in, one way out:
- **evicted**: a cached block with refcount 0 about to be reused is booked device -> host first;
- **idle**: `offload_idle(now, idle_s, evictable)`, called by the engine each step, books every
  cached block idle for `idle_s` or more; the device copy stays evictable (it counts as free);
- **restore**: a prompt whose leading blocks miss the device cache continues its chain in the
  tier (`hits`); each hit gets a fresh device block and a host -> device copy, counts as cached,
  and joins the prefix cache once the step ran (`mark_computed`).
A block's idle clock starts at the last `offload_idle` before it was freed. A restore into a block
freed again in the same step is cancelled and the block uncached.

Left out on purpose: host hits after a device hit that follows a miss (the chain is device
blocks, then host blocks, then misses), restoring asynchronously while the step runs.
"""
from collections import OrderedDict

from minillm.paging.host_tier import HostTier
from minillm.paging.prefix_cache import PrefixCache


class OffloadManager:
    """The copies booked between a device pool and its host tier `tier` (None: no tier). Reads
    `prefix_cache` (the same owner's) for each block's hash and token prefix."""

    def __init__(self, tier: HostTier | None, prefix_cache: PrefixCache, prefix_caching: bool):
        if tier is not None and not isinstance(tier, HostTier):
            raise TypeError(f"host_tier must be a HostTier or None, got {type(tier).__name__}")
        if tier is not None and not prefix_caching:
            raise ValueError("a host tier needs enable_prefix_caching=True (it keeps and finds "
                             "prefix-cache blocks)")
        self.tier, self.prefix_cache = tier, prefix_cache
        self.now = 0.0                                 # the engine clock at the last offload_idle
        self._unstored: OrderedDict[int, float] = OrderedDict()  # evictable block -> idle since
        self._offloads: list[tuple[int, int]] = []      # (device block, host slot), in order
        self._restores: dict[int, int] = {}             # device block -> host slot

    # ---- in -------------------------------------------------------------------------------
    def _store(self, b: int) -> int | None:
        """Book cached block b's KV into the tier; the host slot, or None if nothing to copy."""
        entry = self.prefix_cache.entry(b)
        if self.tier is None or entry is None or entry.node is None:
            return None
        slot = self.tier.store(entry.hash, entry.node)
        if slot is not None:
            self._offloads.append((b, slot))
        return slot

    def evicted(self, b: int) -> None:
        """b, a cached block with refcount 0, is about to be reused: keep its KV in the tier."""
        if self.tier is not None:
            self._unstored.pop(b, None)
            self._store(b)

    def cancel_restore(self, b: int) -> bool:
        """b's refcount dropped to 0: a restore into it the runner has not made yet is cancelled
        (True: there was one, so b's KV was never written)."""
        return self._restores.pop(b, None) is not None

    def start_idle_clock(self, b: int) -> None:
        """b, cached, is now evictable: it is idle from the last `offload_idle` on."""
        if self.tier is not None:
            self._unstored.pop(b, None)
            self._unstored[b] = self.now

    def offload_idle(self, now: float, idle_s: float, evictable) -> int:
        """Book every block of `evictable` idle since `now - idle_s` or earlier into the tier (it
        stays in the device's evictable pool); returns how many copies were booked."""
        self.now, n = now, 0
        while self._unstored and next(iter(self._unstored.values())) <= now - idle_s:
            b, _ = self._unstored.popitem(last=False)
            if b in evictable and self._store(b) is not None:   # else revived meanwhile
                n += 1
        if self.tier is not None:
            self.tier.stats["idle_offloaded_blocks"] += n
        return n

    # ---- out ------------------------------------------------------------------------------
    def hits(self, tokens: list[int], device_hits: list[tuple[int, int]]) -> list:
        """The tier's entries that continue the device hits [(block, hash)] of `tokens`, as
        (hash, HostEntry), in block order; at most (len - 1) // P blocks in all."""
        tier, P = self.tier, self.prefix_cache.block_size
        if tier is None or tier.num_used == 0:
            return []
        parent_hash = device_hits[-1][1] if device_hits else None
        prev = self.prefix_cache.entry(device_hits[-1][0]).node if device_hits else None
        found = []
        for i in range(len(device_hits), (len(tokens) - 1) // P):
            h = self.prefix_cache.block_hash(parent_hash, tuple(tokens[i * P:(i + 1) * P]))
            entry = tier.find(h, tokens, i, P, prev)
            if entry is None:
                break
            found.append((h, entry))
            parent_hash, prev = h, entry.node
        return found

    def pin(self, host_hits: list) -> None:
        """Before fresh blocks are taken (which may store evicted blocks into the tier): the
        slots these hits will be restored from must stay as they are until the copy."""
        for _, entry in host_hits:
            self.tier.pin(entry.slot)

    def book_restores(self, blocks: list[int], host_hits: list) -> None:
        """Fresh device blocks `blocks` receive the host hits' KV (booked, made by the runner)."""
        for b, (h, entry) in zip(blocks, host_hits):
            self._restores[b] = entry.slot
            self.tier.touch(h)

    def pending_restore(self, blocks: list[int]) -> bool:
        """Whether one of `blocks` still waits for its restore (made this step)."""
        return any(b in self._restores for b in blocks)

    # ---- handing the copies to the runner -----------------------------------------------------
    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies booked since the last call: offloads [(device block, host slot)] and
        restores [(host slot, device block)], in the order to make them; unpins the tier."""
        offloads, restores = self._offloads, [(s, b) for b, s in self._restores.items()]
        self._offloads, self._restores = [], {}
        if self.tier is not None:
            self.tier.unpin_all()
            self.tier.stats["restored_blocks"] += len(restores)
        return offloads, restores

    def forget_offloads(self, offloads: list[tuple[int, int]]) -> None:
        """Offloads handed out but maybe never made: their host slots hold nothing known."""
        for _, slot in offloads if self.tier is not None else ():
            self.tier.discard(slot)
