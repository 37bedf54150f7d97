"""The reference model's forward pass as one flat loop: the same maths without its Python.

Letters as in `llama.py`: B batch, T new tokens, H query heads, Hkv kv heads, D head dim,
R = B * T rows, F d_ff.

At batch 1 on a CPU a 135M model's arithmetic is one read of its weights, about 20 ms, and the
eager Python around it (nine module calls per layer, a dozen small tensor ops in each rotation)
added about as much again (issue 13; `bench overhead` measures it on a many-layer tiny model).
`FlatTransformer` is the same model: the same parameters, state_dict and cache protocol. Only
its `forward` differs: one loop over the layers that calls no module (each layer's weights are read
once per pass from the modules' own dicts), looks the matmul route up once per pass instead of once
per projection, rotates q and k with one roll instead of two slices, a negation and a
concatenation, and keeps activations one row per token: a cache that offers `attend_rows` (the
paged one) gets q, k and v as views into the fused projection and answers rows, so the
heads-first transposes and copies on the way in and out are not made (about 38 ATen ops per layer
instead of 47). The arithmetic is the reference's, op for op, so the logits agree bit for bit.
`flatten(model)` switches a model to it in place (`accelerate` does, on a CPU), `unflatten(model)`
switches back.

It runs only where it computes what `llama.py` computes: a CPU, float32 or float64, no autograd,
every module of the reference's own classes (projections `nn.Linear` or `RoutedLinear` without
bias) and no hook on any of them. Anything else (a quantized layer, a forward hook, a
gradient, bfloat16, a GPU) takes the reference forward, so in doubt what runs is what a learner
reads. `tests/test_flat_forward.py` checks logits and caches bit for bit against the reference
and greedy tokens of the real model.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module

from minillm.kernels.cpu_kernels import _PINNED, RoutedLinear, bucket_of, matmul
from minillm.model.llama import (MLP, Attention, Block, DenseCausalAttention, RMSNorm, Transformer,
                                 rope_cos_sin)

_LINEARS = (nn.Linear, RoutedLinear)
_REFERENCE = {"embed": (nn.Embedding,), "layers": (nn.ModuleList,), "norm": (RMSNorm,),
              "lm_head": _LINEARS, "input_norm": (RMSNorm,), "post_attn_norm": (RMSNorm,),
              "attn": (Attention,), "mlp": (MLP,), "qkv_proj": _LINEARS, "o_proj": _LINEARS,
              "gate_up_proj": _LINEARS, "down_proj": _LINEARS}


def _bypassed(model) -> tuple:
    """(layer count, [(owner's submodule dict, name, module, allowed classes)]) for every module
    the flat loop does not call."""
    entries = [(model._modules, n, model._modules.get(n), _REFERENCE[n])
               for n in ("embed", "layers", "norm", "lm_head")]
    for i, blk in enumerate(model.layers):
        entries.append((model.layers._modules, str(i), blk, (Block,)))
        for owner in (blk, blk.attn, blk.mlp):
            entries += [(owner._modules, n, m, _REFERENCE.get(n, ())) for n, m in owner._modules.items()]
    return len(model.layers), entries


class FlatTransformer(Transformer):
    """`Transformer` whose forward is one flat loop where that gives the same function."""

    def forward(self, input_ids, positions=None, cache=None, logits_index=None):
        if not self.flat_ok(input_ids):
            return super().forward(input_ids, positions, cache, logits_index)
        positions = self.check_inputs(input_ids, positions, cache)
        return flat_forward(self, input_ids, positions,
                            cache if cache is not None else DenseCausalAttention(), logits_index)

    def flat_ok(self, input_ids) -> bool:
        """Whether this call may take the flat loop (see the module docstring). The modules are
        listed once (again when one is replaced or a layer added); every call checks that each is
        still in place, of a reference class, bias-free where a projection, and without hooks."""
        if (torch.is_grad_enabled() or input_ids.device.type != "cpu"
                or self.embed.weight.dtype not in (torch.float32, torch.float64)
                or _module._global_forward_hooks or _module._global_forward_pre_hooks):
            return False
        for relist in (False, True):
            listed = self.__dict__.get("_flat_modules")
            if listed is None or relist:
                listed = self.__dict__["_flat_modules"] = _bypassed(self)
            n_layers, entries = listed
            if len(self.layers._modules) != n_layers:
                continue
            for owner, name, m, allowed in entries:
                if owner.get(name) is not m:
                    break                                        # replaced: list them again
                if (type(m) not in allowed or m._forward_hooks or m._forward_pre_hooks
                        or (allowed is _LINEARS and m._parameters.get("bias") is not None)):
                    return False
            else:
                return True
        return False


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


def _layer_weights(model) -> list:
    """Per layer, the tensors the flat loop reads: (input norm weight, eps, qkv, o, post-attention
    norm weight, eps, gate_up, down), the four projections as modules (their routes live there).
    Read once per pass straight from the modules' own dicts, so a replaced parameter is seen on
    the next call and the ~15 attribute lookups per layer through `nn.Module.__getattr__` are not
    paid in the loop."""
    out = []
    for blk in model.layers._modules.values():
        mods = blk._modules
        n1, n2 = mods["input_norm"], mods["post_attn_norm"]
        a, m = mods["attn"]._modules, mods["mlp"]._modules
        out.append((n1._parameters["weight"], n1.eps, a["qkv_proj"], a["o_proj"],
                    n2._parameters["weight"], n2.eps, m["gate_up_proj"], m["down_proj"]))
    return out


def flat_forward(model: Transformer, input_ids, positions, cache, logits_index=None):
    """logits (B, T or T', V) of `model` over input_ids (B, T) at positions (1 or B, T) with
    `cache` (the protocol of llama.py); unchecked: `FlatTransformer.forward` checks first.

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
            enumerate(_layer_weights(model)):
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
