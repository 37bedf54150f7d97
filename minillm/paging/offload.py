"""The block manager's side of the host tier: it books copies, the runner makes them.

Mixed into `BlockManager` next to `PrefixCache`; with `host_tier=None` every method is a no-op.
Nothing here touches a tensor: the scheduler collects the booked copies (`take_kv_moves`) and the
runner makes them before anything else writes those blocks (offloads, swaps and copy-on-write,
restores, then the forward). Two ways in, one way out:
- **evicted**: a cached block with refcount 0 about to be reused is booked device -> host first;
- **idle**: `offload_idle(now, idle_s)`, called by the engine each step, books every cached block
  idle for `idle_s` or more; the device copy stays evictable (it already counts as free);
- **restore**: a prompt whose leading blocks miss the device cache continues its chain in the
  tier (`_host_hits`); each hit gets a fresh device block and a host -> device copy, counts as
  cached, and joins the prefix cache once the step ran (`mark_computed`).
A block's idle clock starts at the last `offload_idle` before it was freed. A restore into a block
freed again in the same step is cancelled and the block uncached.

Left out on purpose: host hits after a device hit that follows a miss (the chain is device
blocks, then host blocks, then misses), restoring asynchronously while the step runs.
"""
from collections import OrderedDict

from minillm.paging.host_tier import HostTier


class Offload:
    """The host-tier bookkeeping, as a mixin: needs the host's `_entry`, `_evictable`, `_seqs`,
    `block_size`, `block_hash` and `_uncache`."""

    def _init_offload(self, host_tier: HostTier | None) -> None:
        if host_tier is not None and not isinstance(host_tier, HostTier):
            raise TypeError(f"host_tier must be a HostTier or None, got {type(host_tier).__name__}")
        if host_tier is not None and not self.enable_prefix_caching:
            raise ValueError("a host tier needs enable_prefix_caching=True (it keeps and finds "
                             "prefix-cache blocks)")
        self.host_tier = host_tier
        self.now = 0.0                                 # the engine clock at the last offload_idle
        self._unstored: OrderedDict[int, float] = OrderedDict()  # evictable block -> idle since
        self._offloads: list[tuple[int, int]] = []      # (device block, host slot), in order
        self._restores: dict[int, int] = {}             # device block -> host slot

    # ---- in -------------------------------------------------------------------------------
    def _store(self, b: int) -> int | None:
        """Book cached block b's KV into the tier; the host slot, or None if nothing to copy."""
        entry = self._entry.get(b)
        if self.host_tier is None or entry is None or entry.node is None:
            return None
        slot = self.host_tier.store(entry.hash, entry.node)
        if slot is not None:
            self._offloads.append((b, slot))
        return slot

    def _offload_evicted(self, b: int) -> None:
        """b, a cached block with refcount 0, is about to be reused: keep its KV in the tier."""
        if self.host_tier is not None:
            self._unstored.pop(b, None)
            self._store(b)

    def _freed(self, b: int) -> None:
        """b's refcount dropped to 0 (it may be cached): start its idle clock, cancel a restore
        into it that the runner has not made yet."""
        if self.host_tier is None:
            return
        if self._restores.pop(b, None) is not None and b in self._entry:
            self._uncache(b)                     # registered, but its KV was never written
            del self._evictable[b]
            self._free.append(b)
        if b in self._evictable:
            self._unstored.pop(b, None)
            self._unstored[b] = self.now

    def offload_idle(self, now: float, idle_s: float) -> int:
        """Book every cached block idle since `now - idle_s` or earlier into the tier (it stays
        in the device's evictable pool); returns how many copies were booked."""
        self.now, n = now, 0
        while self._unstored and next(iter(self._unstored.values())) <= now - idle_s:
            b, _ = self._unstored.popitem(last=False)
            if b in self._evictable and self._store(b) is not None:   # else revived meanwhile
                n += 1
        if self.host_tier is not None:
            self.host_tier.stats["idle_offloaded_blocks"] += n
        return n

    # ---- out ------------------------------------------------------------------------------
    def _host_hits(self, tokens: list[int], hits: list[tuple[int, int]]) -> list:
        """The tier's entries that continue the device hits `hits` [(block, hash)] of `tokens`,
        as (hash, HostEntry), in block order; at most (len - 1) // P blocks in all."""
        tier, P = self.host_tier, self.block_size
        if tier is None or tier.num_used == 0:
            return []
        parent_hash = hits[-1][1] if hits else None
        prev = self._entry[hits[-1][0]].node if hits else None
        found = []
        for i in range(len(hits), (len(tokens) - 1) // P):
            h = self.block_hash(parent_hash, tuple(tokens[i * P:(i + 1) * P]))
            entry = tier.find(h, tokens, i, P, prev)
            if entry is None:
                break
            found.append((h, entry))
            parent_hash, prev = h, entry.node
        return found

    def _pin(self, host_hits: list) -> None:
        """Before fresh blocks are taken (which may store evicted blocks into the tier): the
        slots these hits will be restored from must stay as they are until the copy."""
        for _, entry in host_hits:
            self.host_tier.pin(entry.slot)

    def _book_restores(self, blocks: list[int], host_hits: list) -> None:
        """Fresh device blocks `blocks` receive the host hits' KV (booked, made by the runner)."""
        for b, (h, entry) in zip(blocks, host_hits):
            self._restores[b] = entry.slot
            self.host_tier.touch(h)

    def has_pending_restores(self, seq_id) -> bool:
        """Whether some block of the sequence still waits for its restore (made this step)."""
        return any(b in self._restores for b in self._get(seq_id).table)

    # ---- handing the copies to the runner -----------------------------------------------------
    def take_kv_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies booked since the last call: offloads [(device block, host slot)] and
        restores [(host slot, device block)], in the order to make them; unpins the tier."""
        offloads, restores = self._offloads, [(s, b) for b, s in self._restores.items()]
        self._offloads, self._restores = [], {}
        if self.host_tier is not None:
            self.host_tier.unpin_all()
            self.host_tier.stats["restored_blocks"] += len(restores)
        return offloads, restores

    def forget_moves(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """A step failed after its copies were handed out, so they may not have been made: the
        offloads' host slots and the restores' device blocks lose what they were said to hold."""
        for _, slot in offloads if self.host_tier is not None else ():
            self.host_tier.discard(slot)
        for _, b in restores:
            if b in self._entry:
                self._uncache(b)
                if b in self._evictable:
                    del self._evictable[b]
                    self._free.append(b)
