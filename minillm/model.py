"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Letters: B batch, T new tokens this call, S context (tokens already cached + T), H query heads,
Hkv key/value heads, D head dim, C d_model, F d_ff, V vocab.

The model never stores keys and values itself. Each attention layer projects q, k, v, rotates
q and k, and hands all three to `cache.attend(layer_idx, q, k, v)`; the cache stores k and v
wherever it likes (a contiguous tensor in chapter 0, a pool of pages in chapter 3) and returns
the attention output. With no cache, `DenseCausalAttention` is used: the reference that every
other cache is tested against.

Left out on purpose: dropout, training code, rope scaling variants, sliding windows, biases.
"""
import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32 (or float64) for stability, as the reference implementation does
        dtype = x.dtype
        xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin tables for the given positions: (..., D) each ("rotate half" layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq     # (..., D/2)
    angles = torch.cat([angles, angles], dim=-1)                   # (..., D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (B, H, T, D) by the position angles; cos/sin (B, 1, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# CPU fp32 inference routes of `Linear` (measured in chapter 1 and by `bench decode`):
SMALL_ROWS = 4     # 1..SMALL_ROWS rows (tokens): the skinny route (W @ x^T)^T; 0: off
PREPACKED = True   # more rows: oneDNN's prepacked weights; False: F.linear
PACK_HINT = 64     # the row count oneDNN lays the packed weight out for (measured best, 1-256 rows)
# route -> (SMALL_ROWS, PREPACKED) while `linear_route(route)` is active; "auto" is the default
_ROUTE_SETTINGS = {"auto": (SMALL_ROWS, PREPACKED), "F.linear": (0, False), "skinny": (16, False),
                   "prepacked": (0, True)}
ROUTES = tuple(_ROUTE_SETTINGS)
_PACKED = weakref.WeakKeyDictionary()   # Linear -> (weight key, packed weight); not in state_dict
_PREPACK_OK = (torch.backends.mkldnn.is_available()
               and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Linear):
    """nn.Linear with faster routes for fp32 inference on a CPU.

    A decode step, a speculative verify step (K + 1 tokens) and a small decode batch multiply a
    few rows by a big weight: the cost should be one read of the weight from memory, whatever the
    number of rows. PyTorch's CPU `x @ W^T` (MKL) is far from that on the project's CPU (2-core
    AMD EPYC, fp32): 2-16 rows cost about twice one row. Two routes avoid most of that:

    - skinny (1..SMALL_ROWS rows): the same product as `(W @ x^T)^T`. With more than one thread a
      single row is fed twice, because there the matrix-vector routine (one core) is slower than
      the two-column product (all cores); with one thread one row keeps `F.linear`.
    - prepacked (more rows, with no autograd): oneDNN's matmul on a copy of the weight laid out
      once in its blocked format (the kind of weight prepacking torch.compile's CPU backend
      does for frozen weights). The
      copy is made on first use, kept on the module and remade when the weight changes (another
      tensor, or an in-place write); it doubles the weights' memory. On the real model
      (decode_cpu.json) 9 and 17 new tokens cost about 1.4x and 1.8x one token, against about
      3x through F.linear and 1.9x and 3.2x through the skinny route; 64 tokens 25% less than
      F.linear.

    GPUs, other dtypes, biases and autograd use `F.linear`. `with linear_route("F.linear"):`
    (or "skinny", "prepacked", "auto") picks a route for a block of code, to time them; the
    module flags SMALL_ROWS and PREPACKED set the default. Same math; rounding differs in the last
    bits (tests/test_model.py).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32
                or self.bias is not None or rows == 0):
            return F.linear(x, self.weight, self.bias)
        if rows <= SMALL_ROWS:
            x2 = x.reshape(rows, -1)
            if rows == 1:
                if torch.get_num_threads() == 1:
                    return F.linear(x, self.weight)
                x2 = torch.cat([x2, x2])                            # two rows beat one (see above)
            y = torch.mm(self.weight, x2.t())[:, :rows]             # (out, rows): one pass over W
            return y.t().contiguous().view(*x.shape[:-1], -1)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        packed = self._packed_weight() if PREPACKED and not needs_grad else None
        if packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def _packed_weight(self) -> torch.Tensor | None:
        """The weight in oneDNN's blocked layout (packed on first use, again after any change to
        the weight), or None when this torch or this weight can't take the route."""
        w = self.weight
        if not _PREPACK_OK or w.is_inference():
            return None
        key = (w.data_ptr(), w._version, tuple(w.shape))
        cached = _PACKED.get(self)
        if cached is None or cached[0] != key:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            cached = _PACKED[self] = (key, packed)
        return cached[1]


@contextmanager
def linear_route(route: str = "auto"):
    """Route every `Linear` on CPU fp32 through one route for a block of code, then restore the
    setting: "auto" (skinny for 1-4 rows, prepacked beyond), "F.linear" (PyTorch's own),
    "skinny" (up to 16 rows, then F.linear) or "prepacked" (all rows)."""
    global SMALL_ROWS, PREPACKED
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    saved = SMALL_ROWS, PREPACKED
    SMALL_ROWS, PREPACKED = _ROUTE_SETTINGS[route]
    try:
        yield
    finally:
        SMALL_ROWS, PREPACKED = saved


def skinny_route(on: bool):
    """`linear_route("skinny")` if on (the skinny route up to 16 rows, F.linear beyond) else
    `linear_route("F.linear")`: kept for code written against the first CPU route."""
    return linear_route("skinny" if on else "F.linear")


class DenseCausalAttention:
    """The no-cache reference: causal attention over exactly the tokens passed in."""

    def attend(self, layer_idx: int, q, k, v):
        # q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                              enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k and v come out of one fused matmul: one weight read instead of three
        self.qkv_proj = Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim,
                                  bias=False)
        self.o_proj = Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, cache):
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv_proj(x)                                     # (B, T, (H + 2Hkv) D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)                     # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)                   # (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)                   # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cache.attend(self.layer_idx, q, k, v)                  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)                 # (B, T, C)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down_proj = Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)           # (B, T, F) each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache):
        x = x + self.attn(self.input_norm(x), cos, sin, cache)
        return x + self.mlp(self.post_attn_norm(x))


class Transformer(nn.Module):
    """`model(input_ids)` -> logits (B, T, V). See the module docstring for the cache protocol."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if positions is None:
            start = getattr(cache, "seq_len", 0) if cache is not None else 0
            positions = torch.arange(start, start + T, device=input_ids.device)
        if positions.dim() == 1:
            positions = positions[None, :]                          # (1, T), broadcast over B
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        cos, sin = cos[:, None], sin[:, None]                      # (B or 1, 1, T, D)
        attn_cache = cache if cache is not None else DenseCausalAttention()
        x = self.embed(input_ids)                                  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_cache)
        if logits_index is not None:
            x = x[:, logits_index]                                 # (B, T', C)
        return self.lm_head(self.norm(x))                          # (B, T or T', V)
