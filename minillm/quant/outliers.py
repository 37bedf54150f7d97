"""LLM.int8()'s outlier features, and what they do to int8 *activations* (W8A8).

Letters: T tokens, K a projection's input width, N its output width, O the outlier dims.

Outliers (Dettmers et al. 2022) live in the activations: one entry of 60 sets a token's int8
scale to 60/127 and leaves its ordinary entries a handful of levels; weight-only int8 never sees
them.
- `outlier_dims(X, threshold)`: the input dims of X (T, K) whose |x| reaches the threshold, and
  the fraction of tokens where one does; `outlier_features(model, ids)`: that census for every
  projection, on the fp32 model's activations.
- `W8A8Linear` / `w8a8(model, threshold)`: int8 weights per output channel and int8 activations
  per token, simulated in float; with a threshold, LLM.int8()'s decomposition (columns with some
  |x| >= threshold, found per call, multiplied in fp32).

Left out on purpose: real int8 GEMMs, static activation scales, SmoothQuant-style migration,
the lm_head (kept fp32).
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm._validate import check_real
from minillm.quant.blocks import BlockRunner, record
from minillm.quant.formats import quantize_int8
from minillm.quant.targets import PROJECTIONS


def outlier_dims(X: torch.Tensor, threshold: float = 6.0) -> tuple[list[int], float]:
    """Dims of X (T, K) whose magnitude reaches `threshold` on some token, and the fraction of
    tokens with at least one such value."""
    X = X.reshape(-1, X.shape[-1])
    hit = X.abs() >= threshold                                      # (T, K)
    return hit.any(0).nonzero().flatten().tolist(), hit.any(1).float().mean().item()


@torch.no_grad()
def outlier_features(model, ids, threshold: float = 6.0) -> list[dict]:
    """One row per (layer, projection): its outlier dims, how many, the fraction of tokens they
    touch and the largest |x| seen, on the fp32 model's activations for `ids`."""
    check_real("threshold", threshold, low=0, low_open=True)
    runner = BlockRunner(model, ids)
    x, rows = runner.x0, []
    for i, block in enumerate(model.layers):
        acts, x = record(runner, block, i, x, {p: block.get_submodule(p) for p in PROJECTIONS})
        for p in PROJECTIONS:
            dims, frac = outlier_dims(acts[p], threshold)
            rows.append({"layer": i, "proj": p, "n_dims": len(dims), "dims": dims,
                         "token_frac": frac, "max_abs": acts[p].abs().max().item()})
    return rows


def fake_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 of each row of x (R, K) with its own absmax scale, dequantized again."""
    amax = x.abs().amax(dim=-1, keepdim=True)                       # (R, 1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale).clamp_(-127, 127) * scale


class W8A8Linear(nn.Module):
    """int8 weights (per output channel) x int8 activations (per token), simulated in float;
    `threshold` set: columns with an |x| >= threshold go through fp32 instead (LLM.int8())."""

    def __init__(self, weight: torch.Tensor, threshold: float | None = None):
        super().__init__()
        self.threshold = threshold
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight.detach().clone())     # fp32, for the outlier columns
        self.register_buffer("weight_int8", quantize_int8(weight.detach()).dequantize(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                        # (R, K)
        if self.threshold is None:
            y = F.linear(fake_int8_per_token(x2), self.weight_int8)
        else:
            out = (x2.abs() >= self.threshold).any(0)               # (K,) bool: this call's O
            inl = x2.masked_fill(out, 0)                            # the int8 part, outliers zeroed
            y = F.linear(fake_int8_per_token(inl), self.weight_int8.masked_fill(out, 0))
            y = y + F.linear(x2[:, out], self.weight[:, out])       # (R, O) @ (O, N): fp32
        return y.view(*x.shape[:-1], self.out_features)


def w8a8(model, threshold: float | None = 6.0):
    """A copy of `model` whose projections (not the lm_head) are `W8A8Linear`: threshold=None is
    plain W8A8, a number keeps the dims reaching it in fp32. `model` is left as it is."""
    if threshold is not None:
        check_real("threshold", threshold, low=0, low_open=True)
    out = copy.deepcopy(model)
    for block in out.layers:
        for p in PROJECTIONS:
            parent_name, _, child = p.rpartition(".")
            parent = block.get_submodule(parent_name)
            setattr(parent, child, W8A8Linear(getattr(parent, child).weight, threshold))
    return out
