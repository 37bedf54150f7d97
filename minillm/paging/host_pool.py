"""The host tier's tensors: a second pool of KV blocks in host memory, and the copies per block.

Letters: L layers, Nh host slots, P block size, Hkv kv heads, D head dim.

`HostKVPool(cache, num_blocks)` keeps, for each of the cache's pools, a host tensor
(Nh, 2, L, P, Hkv, D) (int8 scales (Nh, 2, L, P, Hkv)) in the pool's dtype, so a slot is one
contiguous block of K and V across all layers. `store` copies device blocks into slots and
`restore` copies slots back into device blocks; the block manager (offload.py) decides which.
On CUDA the host tensors are pinned and copies are `non_blocking` on the current stream, ordered
before the forward that reads them; on a CPU cache they are memcpys within one memory.
`host_memory_available()` reads MemAvailable from /proc/meminfo (elsewhere `os.sysconf`), so a
tier larger than the machine can hold is refused before anything is allocated.

Left out on purpose: batching the copies of a step into one transfer through a staging buffer,
and copies on a side stream overlapped with the forward (vLLM's offloading connector does both).
"""
import os

import torch

from minillm.paging.paged_cache import PagedKVCache


def host_memory_available() -> int:
    """Bytes of host memory available for new allocations now."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # no /proc (not Linux): free physical pages, a lower bound (the page cache is not counted)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_num_blocks(kv_offloading_size: float | None, bytes_per_block: int) -> int:
    """Host slots in `kv_offloading_size` GiB (None or 0: the tier is off, 0 slots). ValueError
    naming the field when the size holds no block, or exceeds the host memory available now."""
    if not kv_offloading_size:
        return 0
    nbytes = int(kv_offloading_size * 2**30)
    n = nbytes // bytes_per_block
    if n < 1:
        raise ValueError(f"kv_offloading_size={kv_offloading_size} GiB holds no KV block of "
                         f"{bytes_per_block} bytes; use 0 / None (off) or >= "
                         f"{bytes_per_block / 2**30:.3g} GiB")
    avail = host_memory_available()
    if n * bytes_per_block > avail:
        raise ValueError(f"kv_offloading_size={kv_offloading_size} GiB is more than the host "
                         f"memory available now ({avail / 2**30:.2f} GiB MemAvailable); use a "
                         f"size in (0, {avail / 2**30:.2f}]")
    return n


class HostKVPool:
    """Host slots for `num_blocks` blocks of `cache` (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, num_blocks: int):
        self.num_blocks, self.device = num_blocks, cache.k.device
        self.pinned = self.device.type == "cuda"
        # per pool of the cache: (Nh, 2, L, P, Hkv, D) values, or (Nh, 2, L, P, Hkv) scales
        self.pools = [torch.zeros((num_blocks, 2, k.shape[0], *k.shape[2:]), dtype=k.dtype,
                                  pin_memory=self.pinned) for k, _ in cache.pools()]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def store(self, cache: PagedKVCache, pairs) -> None:
        """Device -> host: for each (device block, host slot), the block's K and V, all layers."""
        for (k, v), host in zip(cache.pools(), self.pools):
            for b, slot in pairs:
                host[slot, 0].copy_(k[:, b], non_blocking=self.pinned)       # (L, P, Hkv, D)
                host[slot, 1].copy_(v[:, b], non_blocking=self.pinned)

    def restore(self, cache: PagedKVCache, pairs) -> None:
        """Host -> device: for each (host slot, device block), the slot's K and V, all layers."""
        for (k, v), host in zip(cache.pools(), self.pools):
            for slot, b in pairs:
                k[:, b].copy_(host[slot, 0], non_blocking=self.pinned)       # (L, P, Hkv, D)
                v[:, b].copy_(host[slot, 1], non_blocking=self.pinned)
