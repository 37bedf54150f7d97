"""The target's features a trained drafter reads (Medusa heads, an EAGLE drafter): per sequence,
the final norm's output (`model(..., return_hidden=True)`) at its last W computed positions.

Letters: W rows kept, C model width, S context length.

The features of a context of S tokens are the hidden rows of positions 0..S-2 (the root, the last
sampled token, has not run through the target yet). The engine keeps the last W per sequence,
with the position of the first, and changes them in one place (`update_from_output`): each
scheduled chunk's rows are appended, except a rejected draft's; a chunk that does not continue the
window (a prefix-cache hit, a recompute) starts it afresh; preemption by recompute clears it, by
swap keeps it (as it keeps the KV).

Left out on purpose: features of several layers (EAGLE-3's fusion) and a window that grows with
the context (a drafter with its own KV cache over the whole context).
"""
import torch


class FeatureWindow:
    """Hidden rows (w, C), w <= `window`, of consecutive positions start..start + w - 1."""

    def __init__(self, window: int):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"feature window must be an int >= 1, got {window!r}")
        self.window = window
        self.start = 0
        self.rows: torch.Tensor | None = None                       # (w, C)

    @property
    def end(self) -> int:
        """One past the last position held (== start when empty)."""
        return self.start + (0 if self.rows is None else len(self.rows))

    def extend(self, start: int, rows: torch.Tensor) -> None:
        """Rows (n, C) for positions start..start + n - 1; a gap or an overlap starts afresh."""
        if self.rows is None or start != self.end:
            self.start, self.rows = start, rows
        else:
            self.rows = torch.cat([self.rows, rows])                # (w + n, C)
        drop = max(0, len(self.rows) - self.window)
        self.start, self.rows = self.start + drop, self.rows[drop:].clone()

    def clear(self) -> None:
        self.start, self.rows = 0, None

    def tail(self, num_tokens: int) -> torch.Tensor | None:
        """The features of a context of `num_tokens` tokens that this window holds: rows up to
        position num_tokens - 2, or None when it holds none ending there."""
        if self.rows is None or self.end != num_tokens - 1:
            return None
        return self.rows                                            # (w, C)

    def copy(self) -> "FeatureWindow":
        """For a forked completion: same rows (tensors are never changed in place)."""
        other = FeatureWindow(self.window)
        other.start, other.rows = self.start, self.rows
        return other
