"""What weight quantization acts on, the checks of what it is given, and its baseline: shared by
`api` (the top of quant/), `gptq`, `awq`, `outliers`, `blocks` and `quality`, which import this
module and `formats`, never each other's front door.

Letters: B calibration sequences, T tokens each, N / K a projection's output / input width.

- `PROJECTIONS`, `projections(model)`: the four projections of every block that a method replaces
  (`attn.qkv_proj`, `attn.o_proj`, `mlp.gate_up_proj`, `mlp.down_proj`).
- `check_calibration`, `check_ids`, `check_groups`: token ids and group sizes, checked with a
  message that names the argument and what is allowed.
- `rtn_weights(model, bits, group_size)`: round-to-nearest of every projection, the baseline
  GPTQ and AWQ are compared with.

Left out on purpose: quantizing the embedding / lm_head and the norms (see api.py).
"""
import torch
import torch.nn as nn

from minillm.quant.formats import check_group_size, quantize_int4, quantize_int8

PROJECTIONS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def projections(model) -> dict:
    """module name -> the module, for the projections `quantize` replaces."""
    return {f"layers.{i}.{p}": layer.get_submodule(p)
            for i, layer in enumerate(model.layers) for p in PROJECTIONS}


def check_calibration(calibration, vocab_size: int) -> torch.Tensor:
    """A LongTensor (B, T) or a list of equal-length token-id lists -> LongTensor (B, T), T >= 2."""
    if isinstance(calibration, (list, tuple)):
        rows = list(calibration)
        if not rows or not all(isinstance(r, (list, tuple)) for r in rows):
            raise ValueError("calibration must be a non-empty list of token-id lists (or a "
                             "LongTensor (B, T))")
        if any(isinstance(t, bool) or not isinstance(t, int) for r in rows for t in r):
            raise TypeError("calibration lists must hold int token ids")
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"calibration lists must all have one length, got "
                             f"{sorted({len(r) for r in rows})}")
        calibration = torch.tensor(rows, dtype=torch.long)
    if not isinstance(calibration, torch.Tensor) or calibration.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"calibration must be a LongTensor (B, T) or a list of token-id lists, got "
                        f"{calibration.dtype if isinstance(calibration, torch.Tensor) else type(calibration).__name__}")
    if calibration.dim() != 2 or calibration.shape[0] == 0 or calibration.shape[1] < 2:
        raise ValueError(f"calibration must be (B, T) with B >= 1 and T >= 2, got shape "
                         f"{tuple(calibration.shape)}")
    lo, hi = int(calibration.min()), int(calibration.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"calibration must hold token ids in [0, {vocab_size}) (the model's "
                         f"vocabulary), got values in [{lo}, {hi}]")
    return calibration.long()


def check_ids(name: str, ids, vocab_size: int, min_len: int = 1) -> torch.Tensor:
    """(T,) or (B, T) integer token ids in [0, vocab_size) -> (B, T), or a clear error."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 tensor of token ids, got "
                        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] < min_len:
        raise ValueError(f"{name} must be (T,) or (B, T) with B >= 1 and T >= {min_len}, "
                         f"got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return ids.long()


def check_groups(model, group_size) -> None:
    """Every projection's input width must be divisible by group_size (a clear error if not)."""
    for p in PROJECTIONS:
        check_group_size(group_size, model.layers[0].get_submodule(p).in_features)


def _weight(module: nn.Linear) -> torch.Tensor:
    return module.weight.detach().contiguous()       # tuned CPU layouts may store it transposed


@torch.no_grad()
def rtn_weights(model, bits: int = 4, group_size: int = 32) -> dict:
    """Round-to-nearest of every projection (module name -> weight): int8 per channel (bits=8)
    or int4 in groups of `group_size` (bits=4). The model is not changed."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    quant = quantize_int8 if bits == 8 else (lambda w: quantize_int4(w, group_size))
    return {n: quant(_weight(m)) for n, m in projections(model).items()}
