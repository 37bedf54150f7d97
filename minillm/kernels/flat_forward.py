"""The reference model's forward pass as one flat loop: the same maths without its Python.

Letters as in `llama.py`: B batch, T new tokens, H query heads, Hkv kv heads, D head dim,
R = B * T rows, F d_ff.

At batch 1 on a CPU the eager Python around a small model's forward costs about as much as its
arithmetic. `FlatTransformer` is the same model (parameters, state_dict, cache protocol); only
`forward` differs: one loop that calls no module, one route lookup per pass, a cheaper rotation,
and rows kept one per token so a paged cache (`attend_rows`) gets views, not copies. The
arithmetic is the reference's op for op, so logits agree bit for bit. The switch is visible:
`accelerate(model)` or `flatten(model)` sets the class, `unflatten` or `plain` sets it back. The
flat loop runs only for a call the reference would answer the same way (CPU, fp32/fp64, no
autograd, the reference's own modules, no per-module hooks); anything else takes the reference
forward. Global module hooks are not seen: call `plain(model)` first.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.kernels.cpu_kernels import _PINNED, RoutedLinear, bucket_of, matmul
from minillm.model.llama import (MLP, Attention, Block, DenseCausalAttention, RMSNorm, Transformer,
                                 rope_cos_sin)

_LINEARS = (nn.Linear, RoutedLinear)


class FlatTransformer(Transformer):
    """`Transformer` whose forward is one flat loop where that gives the same function."""

    def forward(self, input_ids, positions=None, cache=None, logits_index=None,
                return_hidden: bool = False):
        layers = self.flat_layers(input_ids)
        if layers is None:
            return super().forward(input_ids, positions, cache, logits_index, return_hidden)
        positions = self.check_inputs(input_ids, positions, cache)
        return flat_forward(self, input_ids, positions,
                            cache if cache is not None else DenseCausalAttention(), logits_index,
                            layers, return_hidden)

    def flat_ok(self, input_ids) -> bool:
        """Whether this call takes the flat loop (see the module docstring's contract)."""
        return self.flat_layers(input_ids) is not None

    def flat_layers(self, input_ids) -> list | None:
        """The per-layer tensors the flat loop reads (`_layer_weights`), or None when this call
        must take the reference forward: autograd on, not a CPU, a dtype other than fp32/fp64,
        or a module that is not of the reference's classes."""
        if (torch.is_grad_enabled() or input_ids.device.type != "cpu"
                or self.embed.weight.dtype not in (torch.float32, torch.float64)
                or type(self.embed) is not nn.Embedding or type(self.norm) is not RMSNorm
                or not _is_projection(self.lm_head) or type(self.layers) is not nn.ModuleList):
            return None
        if _hooked(self.embed) or _hooked(self.norm) or _hooked(self.lm_head) or _hooked(self.layers):
            return None
        return _layer_weights(self)


def _is_projection(m) -> bool:
    return type(m) in _LINEARS and m.bias is None


def _hooked(m) -> bool:
    """A forward (pre-)hook on this module: the flat loop would not call it."""
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _router(rows: int, dtype):
    """linear -> (route, packed copy or None) for this pass: the pinned route, or each
    RoutedLinear's table at this row count; nn.Linear and non-fp32 take F.linear."""
    pinned, bucket = _PINNED.get(), bucket_of(rows)

    def route(lin):
        if type(lin) is not RoutedLinear or dtype is not torch.float32:
            return "F.linear", None
        r = pinned if pinned != "auto" else lin.routes.get(bucket, "F.linear")
        return r, (lin._packed() if r == "prepacked" else None)
    return route


def _layer_weights(model) -> list | None:
    """Per layer, the tensors the flat loop reads: (input norm weight, eps, qkv, o, post-attention
    norm weight, eps, gate_up, down), the four projections as modules (their routes live there);
    None when a layer is not the reference's (a replaced block, norm, attention, MLP or
    projection, or a bias). Read once per pass, so a replaced parameter or module is seen on the
    next call, from each module's own registry (`_modules`, `_parameters`: what `named_modules()`
    and `state_dict()` walk), which skips the ~15 lookups per layer through
    `nn.Module.__getattr__` (measured on a 2-core EPYC: 85 us instead of 460 us a pass for 30 layers)."""
    out = []
    for blk in model.layers._modules.values():
        if type(blk) is not Block:
            return None
        mods = blk._modules
        n1, n2, attn, mlp = mods["input_norm"], mods["post_attn_norm"], mods["attn"], mods["mlp"]
        if type(n1) is not RMSNorm or type(n2) is not RMSNorm or type(attn) is not Attention \
                or type(mlp) is not MLP:
            return None
        a, m = attn._modules, mlp._modules
        projs = (a["qkv_proj"], a["o_proj"], m["gate_up_proj"], m["down_proj"])
        for p in projs:
            if type(p) not in _LINEARS or p._parameters.get("bias") is not None:
                return None
        if any(map(_hooked, (blk, n1, n2, attn, mlp, *projs))):
            return None
        out.append((n1._parameters["weight"], n1.eps, projs[0], projs[1],
                    n2._parameters["weight"], n2.eps, projs[2], projs[3]))
    return out


def flat_forward(model: Transformer, input_ids, positions, cache, logits_index=None, layers=None,
                 return_hidden: bool = False):
    """logits (B, T or T', V) (with `return_hidden`, also the final norm's output (B, T, C)) of `model` over input_ids (B, T) at positions (1 or B, T) with
    `cache` (the protocol of llama.py); unchecked: `FlatTransformer.forward` checks first and
    passes `layers` (`_layer_weights(model)`).

    Activations are one row per token, (R, ...), from the embedding to the logits. A cache with
    `attend_rows` (the paged one) takes q (R, H, D) and k, v (R, Hkv, D) as views into the fused
    projection and answers (R, H, D); any other gets the reference's heads-first tensors."""
    cfg = model.config
    B, T = input_ids.shape
    H, Hkv, D, half = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.head_dim // 2
    R, dtype = B * T, model.embed.weight.dtype
    route = _router(R, dtype)
    # rows for a flattened batch (1, M), the one the paged cache takes; other shapes go to
    # `attend`, which answers them as the reference's forward would (or refuses them)
    rows = getattr(cache, "attend_rows", None) if B == 1 else None
    cos, sin = rope_cos_sin(positions, D, cfg.rope_theta, dtype)   # (1 or B, T, D)
    # rotate-half as one roll: cat(-x2, x1) * sin == roll(x, D/2) * cat(-sin1, sin2)
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    cos, sin = (t.expand(B, T, D).reshape(R, 1, D) for t in (cos, sin))   # (R, 1, D)
    x = F.embedding(input_ids, model.embed.weight).view(R, -1)     # (R, C)
    for i, (w1, eps1, qkv_proj, o_proj, w2, eps2, gate_up_proj, down_proj) in \
            enumerate(layers if layers is not None else _layer_weights(model)):
        h = F.rms_norm(x, x.shape[-1:], w1, eps1)
        qkv = _linear(h, qkv_proj, route).view(R, H + 2 * Hkv, D)
        qk = qkv[:, :H + Hkv]                                      # (R, H + Hkv, D), a view
        qk = qk * cos + qk.roll(half, -1) * sin                    # rotated q and k, new tensor
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]           # (R, H or Hkv, D) views
        if rows is not None:
            y = rows(i, q, k, v)                                   # (R, H, D)
        else:                                                      # heads first, as llama.py
            q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))
            y = cache.attend(i, q, k, v, positions).transpose(1, 2)   # (B, T, H, D)
        x = x + _linear(y.reshape(R, H * D), o_proj, route)
        h = F.rms_norm(x, x.shape[-1:], w2, eps2)
        gate, up = _linear(h, gate_up_proj, route).chunk(2, -1)    # (R, F) views each
        x = x + _linear(F.silu(gate) * up, down_proj, route)
    x = x.view(B, T, -1)
    if return_hidden:
        hidden = F.rms_norm(x, x.shape[-1:], model.norm.weight, model.norm.eps)   # (B, T, C)
        rows = hidden if logits_index is None else hidden[:, logits_index]
        Bo, To, C = rows.shape
        return _linear(rows.reshape(Bo * To, C), model.lm_head, route).view(Bo, To, -1), hidden
    if logits_index is not None:
        x = x[:, logits_index]                                     # (B, T', C)
    Bo, To, C = x.shape
    x = F.rms_norm(x, (C,), model.norm.weight, model.norm.eps).reshape(Bo * To, C)
    return _linear(x, model.lm_head, route).view(Bo, To, -1)       # (B, T or T', V)


def _linear(x, lin, route):
    r, packed = route(lin)
    w = lin._parameters["weight"]
    if r == "F.linear":
        return F.linear(x, w)
    return matmul(x, w, r, lin.splits, packed)


def flatten(model: nn.Module) -> nn.Module:
    """Switch a minillm `Transformer` to `FlatTransformer` in place (returns it); other models
    are returned as they are."""
    if type(model) is Transformer:
        model.__class__ = FlatTransformer
    return model


def unflatten(model: nn.Module) -> nn.Module:
    """Undo `flatten`: the reference forward again."""
    if type(model) is FlatTransformer:
        model.__class__ = Transformer
    return model
