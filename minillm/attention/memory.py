"""`peak_bytes(fn, *args, **kwargs)`: how many bytes of tensors a call holds at once, at its worst.

A `TorchDispatchMode` sees every aten op the call runs. An op whose output lives in a storage that
none of its inputs uses has allocated it: we add the storage's bytes to a live total and follow
the tensors that use it (the output and, later, views of it) with weakref finalizers; when the
last of them is gone the storage is freed and its bytes leave the total. The peak of the total is
the answer, the result included if it is still alive when `fn` returns. The count depends only on
the ops and the shapes, not on the allocator, the threads or the machine: a deterministic stand-in
for `torch.cuda.max_memory_allocated` that runs on a CPU (and counts the same on a GPU).

Left out on purpose: allocator rounding and caching (we count `nbytes`), scratch memory a kernel
allocates inside C++ without returning it as a tensor, and tensors that existed before the call
(inputs are not counted; an in-place op on them allocates nothing).
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _LiveStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.holders: dict[int, int] = {}       # storage key -> live tensors that use it
        self.sizes: dict[int, int] = {}         # storage key -> bytes
        self.live = self.peak = 0

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata     # the StorageImpl: shared by views, unique per allocation

    def _release(self, key: int) -> None:
        self.holders[key] -= 1
        if self.holders[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.holders[key]

    def _hold(self, t: torch.Tensor, key: int) -> None:
        self.holders[key] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {self._key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        seen = set()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))
            key = self._key(t)
            if key in self.holders:                         # a view of a storage we follow
                self._hold(t, key)
            elif key not in inputs and t.untyped_storage().nbytes() > 0:   # a new allocation
                self.holders[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
                self._hold(t, key)
        return out


def peak_bytes(fn, *args, **kwargs):
    """Run fn(*args, **kwargs) -> (its result, the peak bytes of tensors it had allocated and
    still held at one time). Deterministic: the same on every machine for the same ops."""
    mode = _LiveStorages()
    with mode:
        result = fn(*args, **kwargs)
    return result, mode.peak
