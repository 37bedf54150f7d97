"""`minillm.quantize(model, method)`: swap every projection of a model for a quantized one.

Letters: B calibration sequences, T tokens each, N / K a projection's output / input width.

The model is changed **in place** and returned (fp32 projection weights freed); the engine,
`generate` and `LLM` run it unchanged. Keep an fp32 copy with `quantize(copy.deepcopy(model), ...)`.
Quantized: the four projections of every block. Not: the norms and the token embedding, tied to
`lm_head` (fp32 by default, counted by `quantized_bytes`); `lm_head="int8"` or `"int4"` gives
the output projection its own quantized copy. int8's fast routes are picked per machine by
`routes.choose_routes`. Methods: "int8" per output channel (group_size None); "int4"
round-to-nearest in groups (default 32); "gguf" the shipped file's own Q4_1 blocks (shipped
SmolLM2 only); "gptq" and "awq" int4 from a calibration set. Everything is checked and built
before the first swap, so a refused call leaves the model as it was. The projections, the checks
of calibration ids and `rtn_weights` live in `targets.py`.

Left out on purpose: quantizing the embedding lookup, mixed formats per layer, saving and
loading quantized checkpoints.
"""
import warnings

import torch

from minillm.model.config import get_config
from minillm.model.llama import Transformer
from minillm.quant.awq import awq_weights
from minillm.quant.formats import check_group_size, quantize_int4, quantize_int8
from minillm.quant.gguf import gguf_weights
from minillm.quant.gptq import gptq_weights
from minillm.quant.linear import Int4Linear, Int8Linear, check_path
from minillm.quant.routes import choose_routes
from minillm.quant.targets import check_calibration, projections, rtn_weights

METHODS = ("int8", "int4", "gguf", "gptq", "awq")
LM_HEADS = (None, "int8", "int4")
DEFAULT_GROUP = 32


def is_quantized(model) -> bool:
    return any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())


def _check(model, method, group_size, calibration, path, lm_head=None, allow_w8a8=False):
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a minillm Transformer, got {type(model).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_path(path)
    if not isinstance(allow_w8a8, bool):
        raise TypeError(f"allow_w8a8 must be a bool, got {type(allow_w8a8).__name__}")
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {LM_HEADS}, got {lm_head!r}")
    if is_quantized(model):
        raise ValueError("model is already quantized; quantize a float model (load it again, or "
                         "keep a copy.deepcopy before the first quantize)")
    if method == "int8" and group_size is not None:
        raise ValueError(f"group_size must be None for int8 (one scale per output channel), "
                         f"got {group_size!r}")
    if method == "gguf" and group_size not in (None, 32):
        raise ValueError(f"group_size must be None or 32 for gguf (Q4_1 blocks hold 32 weights), "
                         f"got {group_size!r}")
    if method == "gguf":
        _check_smollm2_shape(model.config)
    group = None if method == "int8" else (DEFAULT_GROUP if group_size is None else group_size)
    if group is not None:
        for name, module in projections(model).items():
            try:
                check_group_size(group, module.in_features)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (the input width of {name})") from None
    if lm_head == "int4":
        try:
            check_group_size(group or DEFAULT_GROUP, model.config.d_model)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (the input width of lm_head)") from None
    if method in ("gptq", "awq"):
        if calibration is None:
            raise ValueError(f"method={method!r} needs calibration token ids (a LongTensor (B, T) "
                             f"or a list of token-id lists)")
        calibration = check_calibration(calibration, model.config.vocab_size)
    elif calibration is not None:
        raise ValueError(f"calibration is only used by 'gptq' and 'awq', not method={method!r}")
    return group, calibration


def _check_smollm2_shape(cfg) -> None:
    """The cheap half of "is this the shipped SmolLM2?" (the weights are compared once read)."""
    ref = get_config("smollm2-135m")
    fields = ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff", "vocab_size")
    if any(getattr(cfg, f) != getattr(ref, f) for f in fields):
        raise ValueError(f"method='gguf' needs the shipped SmolLM2-135M (minillm.load_model()); "
                         f"model has the shape of {cfg.name!r}")


@torch.no_grad()
def _new_weights(model, method, group, calibration):
    """module name -> Int8Weight / Int4Weight, and parameter name -> new value (AWQ's folds)."""
    mods = projections(model)
    if method in ("int8", "int4"):
        return rtn_weights(model, 8 if method == "int8" else 4, group), {}
    if method == "gguf":
        weights = gguf_weights()
        _check_same_model(mods, weights)
        return weights, {}
    if method == "gptq":
        return gptq_weights(model, calibration, group), {}
    return awq_weights(model, calibration, group)


def _check_same_model(mods: dict, weights: dict) -> None:
    """gguf replaces the weights by the file's: only right if they are the file's already."""
    for name, module in mods.items():
        w = weights.get(name)
        if w is None or tuple(w.q.shape) != tuple(module.weight.shape) or not torch.equal(
                w.dequantize(module.weight.dtype).to(module.weight.device), module.weight):
            raise ValueError(f"method='gguf' needs the shipped SmolLM2 (minillm.load_model()): "
                             f"model's {name} is not the GGUF file's dequantized weight")


def _on(w, device):
    """An Int8Weight / Int4Weight with its tensors on `device`."""
    return type(w)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                      for k, v in vars(w).items()})


def _check_folds(model, folds: dict) -> dict:
    params = dict(model.named_parameters())
    for name, value in folds.items():
        if name not in params or tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(f"the calibration method returned a value for {name!r} that does "
                             f"not match a parameter of the model")
    return params


def _build(weights: dict, head, cls, path: str, device) -> dict:
    """The new modules, every one probed; a missing fast kernel is told once per format and
    device for the whole model (the modules share what they have told)."""
    told: set = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = {n: cls(_on(w, device), path=path) for n, w in weights.items()}
        if head is not None:
            new["lm_head"] = head[0](_on(head[1], device), path=path)
    for m in new.values():
        told |= m._fallback_seen
        m._fallback_seen = told
    for line in dict.fromkeys(str(w.message) for w in caught):
        warnings.warn(line, stacklevel=3)
    return new


def quantize(model, method: str = "int4", group_size: int | None = None, calibration=None,
             path: str = "auto", lm_head: str | None = None, allow_w8a8: bool = False):
    """Replace the model's projections by quantized ones, in place; returns the model.

    method: "int8" | "int4" | "gguf" | "gptq" | "awq"; group_size: int4 groups along the input
    (default 32; None for int8); calibration: token ids for gptq / awq; path: "auto" | "fast"
    (this machine's chosen fast route, `routes.py`) | "reference" (see `quant.linear`);
    lm_head: None (the fp32 embedding is the output projection) | "int8" | "int4" (a quantized
    copy for the output projection; the embedding lookup keeps the fp32 table); allow_w8a8:
    let int8 race its W8A8 route (8-bit activations: faster on some CPUs, less accurate).

    >>> model, tok = load_model()
    >>> quantize(model, "gguf")          # the shipped Q4_1 blocks: the same weights, 5 bits each
    """
    group, calibration = _check(model, method, group_size, calibration, path, lm_head, allow_w8a8)
    weights, folds = _new_weights(model, method, group, calibration)
    mods = projections(model)
    if set(weights) != set(mods):
        raise ValueError(f"method={method!r} returned weights for {len(weights)} modules, "
                         f"expected exactly {sorted(mods)[:2]}...")
    for name, w in weights.items():
        if tuple(w.q.shape) != tuple(mods[name].weight.shape):
            raise ValueError(f"method={method!r} returned a {tuple(w.q.shape)} weight for {name}, "
                             f"whose weight is {tuple(mods[name].weight.shape)}")
    params = _check_folds(model, folds)
    cls = Int8Linear if method == "int8" else Int4Linear
    head = None
    if lm_head is not None:
        w = model.lm_head.weight.detach()
        head = (Int8Linear, quantize_int8(w)) if lm_head == "int8" else \
            (Int4Linear, quantize_int4(w, group or DEFAULT_GROUP))
    new = _build(weights, head, cls, path, model.device)
    with torch.no_grad():                                      # all checked: now swap everything
        for name, value in folds.items():
            params[name].copy_(value)
        for name, module in new.items():
            if "." in name:
                parent, child = name.rsplit(".", 1)
                setattr(model.get_submodule(parent), child, module)
            else:
                setattr(model, name, module)
    if path != "reference":
        choose_routes(model, allow_w8a8=allow_w8a8)
    return model


def set_path(model, path: str):
    """Send every quantized projection through `path` ("reference", "fast" or "auto"); returns
    the model. Nothing is changed when some module refuses "fast"."""
    check_path(path)
    mods = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    before = [m.path for m in mods]
    try:
        for m in mods:
            m.set_path(path)
    except ValueError:
        for m, p in zip(mods, before):
            m.set_path(p)
        raise
    return model


def quantized_bytes(model) -> dict:
    """Bytes of the model's weights by format ("int8", "int4_g32", "float32", ...) and "total"
    (what the model holds; a tied weight, embedding = lm_head, counted once). Beside them:

    - "read_per_step": what one batch-1 decode step reads, so read_per_step / bandwidth is the
      step's floor: each quantized projection as its active kernel reads it (the kernel's packed
      copy where it reads one, `read_nbytes`), the float parameters, and the embedding in full
      only when it is also the output projection (one row per token otherwise);
    - "embedding": the float embedding table held (inside "total");
    - "fast_path_copies": the fast kernels' own copies of the codes, when any: memory held beside
      the weights, outside "total"."""
    out, seen = {}, set()
    qmods = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    for module in qmods:
        fmt = module.format + (f"_g{module.group_size}" if module.format == "int4" else "")
        out[fmt] = out.get(fmt, 0) + module.nbytes
    for p in model.parameters():                      # the float parameters left: norms, embed
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            fmt = str(p.dtype).replace("torch.", "")
            out[fmt] = out.get(fmt, 0) + p.numel() * p.element_size()
    out["total"] = sum(out.values())
    emb = model.embed.weight
    emb_bytes = emb.numel() * emb.element_size()
    is_head = getattr(model.lm_head, "weight", None) is emb
    out["read_per_step"] = (sum(m.read_nbytes() for m in qmods)
                            + sum(p.numel() * p.element_size() for p in model.parameters()
                                  if p is not emb)
                            + (emb_bytes if is_head else emb.shape[1] * emb.element_size()))
    out["embedding"] = emb_bytes
    extra = sum(m.kernel_nbytes for m in qmods)
    if extra:
        out["fast_path_copies"] = extra      # held beside the weights, not read by a step: not in total
    return out
