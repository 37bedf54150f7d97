"""AWQ-style activation-aware scaling before round-to-nearest int4.

Letters: N output features, K input features, G group size, T calibration tokens, X (T, K),
H query heads, Hkv key/value heads, D head dim, F d_ff.

X W^T = (X / s) (W * s)^T for any positive per-input-channel scale s, so the columns of W that
meet large activations can get a finer share of their group's int4 grid. AWQ takes
s = mean|x|^a (normalized so max * min = 1) and grid-searches a in [0, 1] per layer for the
smallest output error on the calibration activations (a = 0 is plain round-to-nearest). 1/s is
folded into what produces X: `input_norm.weight` (qkv_proj), `post_attn_norm.weight`
(gate_up_proj), the "up" rows of gate_up_proj (down_proj), and the value rows of qkv_proj
(o_proj, one scale per kv head and dim, shared by its GQA group). Each fold is tested to leave
the logits unchanged; activations come from the fp32 model.

Left out on purpose: AWQ's weight-clipping search, searching on the block's output instead of
each layer's, and a fused kernel (the result is ordinary Int4Weight).
"""
import torch

from minillm._validate import check_int, check_real
from minillm.quant.blocks import BlockRunner, record
from minillm.quant.formats import quantize_int4
from minillm.quant.targets import PROJECTIONS, check_groups


def _output_error(d: torch.Tensor, X: torch.Tensor, Hx: torch.Tensor | None) -> float:
    """||X d^T||^2 for a weight difference d (N, K), through X^T X when that is cheaper."""
    if Hx is not None:
        return float(((d @ Hx) * d).sum())                         # (N, K) @ (K, K)
    return float((X @ d.t()).pow(2).sum())                         # (T, K) @ (K, N)


def awq_scale(w: torch.Tensor, X: torch.Tensor, group_size: int, n_grid: int = 20,
              tie=None, alpha: float | None = None) -> tuple[torch.Tensor, float]:
    """The searched scale s (K,) for weight w (N, K) and inputs X (T, K), and its exponent a
    (searched over k / n_grid, k = 0..n_grid; `alpha` fixes it instead). `tie(v)` maps a
    per-channel statistic (K,) to fewer free scales and `tie.expand` back."""
    dtype = torch.promote_types(w.dtype, torch.float32)
    w, X = w.to(dtype), X.to(dtype)
    Hx = X.t() @ X if X.shape[0] > X.shape[1] else None            # (K, K)
    stat = X.abs().mean(0).clamp(min=1e-5)                        # (K,)
    base = tie(stat) if tie is not None else stat
    best = (float("inf"), None, 0.0)
    for a in [k / n_grid for k in range(n_grid + 1)] if alpha is None else [alpha]:
        s = base ** a
        s = s / (s.max() * s.min()).sqrt()
        s = tie.expand(s) if tie is not None else s                # (K,)
        wq = quantize_int4(w * s, group_size).dequantize() / s     # (N, K)
        err = _output_error(w - wq, X, Hx)
        if err < best[0]:
            best = (err, s, a)
    return best[1], best[2]


class _GroupTie:
    """Per (kv head, dim) scales for o_proj's H * D inputs (see the module docstring)."""

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int):
        self.rep, self.n_kv, self.D = n_head // n_kv_head, n_kv_head, head_dim

    def __call__(self, v):                                         # (H * D,) -> (Hkv * D,)
        return v.view(self.n_kv, self.rep, self.D).mean(1).reshape(-1)

    def expand(self, s):                                           # (Hkv * D,) -> (H * D,)
        return s.view(self.n_kv, 1, self.D).expand(-1, self.rep, -1).reshape(-1)

    def take(self, s):                                             # (H * D,) -> (Hkv * D,)
        return s.view(self.n_kv, self.rep, self.D)[:, 0].reshape(-1)   # the group's shared value


def _subsample(X: torch.Tensor, n: int | None) -> torch.Tensor:
    if n is None or n >= X.shape[0]:
        return X
    return X[torch.linspace(0, X.shape[0] - 1, n).long()]        # evenly spaced tokens: (n, K)


@torch.no_grad()
def awq_fold(model, calibration, group_size: int, n_grid: int = 20,
             search_tokens: int | None = None, alpha: float | None = None) -> tuple[dict, dict]:
    """The searched scales folded in, nothing quantized yet: the scaled fp weights of the four
    projections of every layer (by module name) and the new values of the fp parameters that
    took the 1/s (by `named_parameters()` name). `model` is not modified. `search_tokens` evenly
    subsamples the calibration tokens the search uses (speed); `alpha` in [0, 1] skips the
    search and uses that exponent everywhere."""
    check_groups(model, group_size)
    check_int("n_grid", n_grid, 1)
    if alpha is not None:
        check_real("alpha", alpha, 0, 1)
    if search_tokens is not None:
        check_int("search_tokens", search_tokens, 1)
    cfg = model.config
    tie = _GroupTie(cfg.n_head, cfg.n_kv_head, cfg.head_dim)
    v_rows = slice((cfg.n_head + cfg.n_kv_head) * cfg.head_dim, None)
    up_rows = slice(cfg.d_ff, None)
    runner = BlockRunner(model, calibration)
    x, weights, params = runner.x0, {}, {}
    for i, block in enumerate(model.layers):
        mods = {p: block.get_submodule(p) for p in PROJECTIONS}
        acts, x_next = record(runner, block, i, x, mods)
        acts = {p: _subsample(a, search_tokens) for p, a in acts.items()}
        W = {p: m.weight.detach().clone() for p, m in mods.items()}
        s = awq_scale(W["attn.o_proj"], acts["attn.o_proj"], group_size, n_grid, tie, alpha)[0]
        W["attn.o_proj"] *= s
        W["attn.qkv_proj"][v_rows] /= tie.take(s)[:, None]
        s = awq_scale(W["mlp.down_proj"], acts["mlp.down_proj"], group_size, n_grid, alpha=alpha)[0]
        W["mlp.down_proj"] *= s
        W["mlp.gate_up_proj"][up_rows] /= s[:, None]
        for p, norm in (("attn.qkv_proj", "input_norm"), ("mlp.gate_up_proj", "post_attn_norm")):
            s = awq_scale(W[p], acts[p], group_size, n_grid, alpha=alpha)[0]
            W[p] *= s
            params[f"layers.{i}.{norm}.weight"] = block.get_submodule(norm).weight.detach() / s
        weights.update({f"layers.{i}.{p}": W[p] for p in PROJECTIONS})
        x = x_next
    return weights, params


def awq_weights(model, calibration, group_size: int, n_grid: int = 20,
                search_tokens: int | None = None, alpha: float | None = None) -> tuple[dict, dict]:
    """AWQ int4: `awq_fold`'s scaled weights rounded to nearest in groups (Int4Weight by module
    name), and the folded fp parameters. `model` is not modified."""
    folded, params = awq_fold(model, calibration, group_size, n_grid, search_tokens, alpha)
    return {k: quantize_int4(w, group_size) for k, w in folded.items()}, params
