"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Letters: B batch, T new tokens this call, S context (tokens already cached + T), H query heads,
Hkv key/value heads, D head dim, C d_model, F d_ff, V vocab.

The model never stores keys and values. Each attention layer hands q, k, v (q and k rotated) to
`cache.attend(layer_idx, q, k, v, positions)`, and the cache stores k and v where it likes and
returns the attention output. `layer_idx` is the layer's place in this model's own stack;
positions are required with a cache (RoPE angles and cache slots come from them). With no cache,
`DenseCausalAttention` runs: the reference every other cache is tested against.

Every projection is a plain `nn.Linear` and this file imports only the config: it is the ground
floor. Speed is switched on from outside: the front door's `minillm.load_model` calls
`minillm.kernels.cpu_tuning.accelerate` on a CPU (timed matmuls, `kernels/flat_forward.py`);
`plain(model)` gives this forward back.

Left out on purpose: dropout, training code, rope scaling variants, sliding windows, biases.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype in (torch.float32, torch.float64):        # PyTorch's fused op, same formula
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # 16-bit inputs: normalize in float32 for stability, as the reference implementation does
        xf = x.float()
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


class DenseCausalAttention:
    """The no-cache reference: causal attention over exactly the tokens passed in."""

    def attend(self, layer_idx: int, q, k, v, positions=None):
        # q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, H, T, D); the T tokens are the whole context
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                              enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # q, k and v come out of one fused matmul: one weight read instead of three
        self.qkv_proj = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim,
                                  bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, cache, layer_idx: int, positions):
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, D)          # (B, T, H + 2Hkv, D)
        qk, v = qkv.split([H + Hkv, Hkv], dim=2)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)              # (B, H + Hkv, T, D): one rotation
        q, k = qk.split([H, Hkv], dim=1)                           # (B, H, T, D), (B, Hkv, T, D)
        v = v.transpose(1, 2)                                      # (B, Hkv, T, D)
        y = cache.attend(layer_idx, q, k, v, positions)            # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)                 # (B, T, C)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

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

    def forward(self, x, cos, sin, cache, layer_idx: int, positions):
        x = x + self.attn(self.input_norm(x), cos, sin, cache, layer_idx, positions)
        return x + self.mlp(self.post_attn_norm(x))


class Transformer(nn.Module):
    """`model(input_ids)` -> logits (B, T, V). See the module docstring for the cache protocol."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, logits_index: torch.Tensor | None = None,
                return_hidden: bool = False):
        """logits (B, T or T', V); with `return_hidden`, (logits, hidden): hidden (B, T, C) is the
        final norm's output at every new token, the features trained drafters read (chapter 10)."""
        positions = self.check_inputs(input_ids, positions, cache)    # (1, T) or (B, T)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        cos, sin = cos[:, None], sin[:, None]                      # (B or 1, 1, T, D)
        attn_cache = cache if cache is not None else DenseCausalAttention()
        x = self.embed(input_ids)                                  # (B, T, C)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_cache, i, positions)
        if return_hidden:
            hidden = self.norm(x)                                  # (B, T, C)
            rows = hidden if logits_index is None else hidden[:, logits_index]
            return self.lm_head(rows), hidden                      # (B, T or T', V), (B, T, C)
        if logits_index is not None:
            x = x[:, logits_index]                                 # (B, T', C)
        return self.lm_head(self.norm(x))                          # (B, T or T', V)

    def check_inputs(self, input_ids, positions, cache) -> torch.Tensor:
        """input_ids (B, T) and positions (T,), (1, T) or (B, T) -> positions as (1 or B, T)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required when a cache is passed: the cache stores "
                                 "each token at its position (e.g. torch.arange(start, start + T))")
            positions = torch.arange(T, device=input_ids.device)
        if positions.dim() == 1:
            positions = positions[None, :]                          # (1, T), broadcast over B
        if positions.dim() != 2 or positions.shape[1] != T or positions.shape[0] not in (1, B):
            raise ValueError(f"positions must be (T,), (1, T) or (B, T) with B={B}, T={T}, "
                             f"got shape {tuple(positions.shape)}")
        return positions
