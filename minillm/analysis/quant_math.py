"""Chapter 7's arithmetic: how many bytes a model's weights take in each number format, with the
scales and offsets the format stores (they are not free).

Letters: N output features of a projection, K input features, G group size (weights sharing one
scale, along K), L layers, V vocabulary, C d_model.

A format stores `bits` per weight plus metadata:
- "fp32", "bf16", "fp16", "fp8": nothing else (fp8 with one per-tensor scale, negligible);
- "int8": one fp32 scale per output row (per channel): 32 bits per K weights;
- "int4": per group of G, an fp16 scale and an fp16 offset (llama.cpp's Q4_1, GPTQ and AWQ with
  zero points): 32 bits per G weights, 5 bits per weight at G = 32, 4.25 at G = 128;
- "int4-sym": per group, an fp16 scale only (16 bits per G weights).
The projections of every layer take the format; the embedding, an untied lm_head and the norms
keep `other_dtype` (`quantize` keeps them in the model's dtype; most published int4 checkpoints
keep them in fp16; llama.cpp's files quantize them too, which is not modelled here).

Left out on purpose: double-quantized scales (QLoRA's NF4), k-quants' super-blocks, and sparsity.
"""
from minillm._validate import check_int
from minillm.analysis.roofline import dtype_bytes
from minillm.model.config import ModelConfig

# format -> (bits per weight, metadata bits per group, where groups run)
FORMATS = {"fp32": (32, 0, None), "bf16": (16, 0, None), "fp16": (16, 0, None), "fp8": (8, 0, None),
           "int8": (8, 32, "row"), "int4": (4, 32, "group"), "int4-sym": (4, 16, "group")}


def _check_format(fmt: str, group_size):
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if FORMATS[fmt][2] == "group":
        check_int("group_size", group_size, 2)
    elif group_size is not None:
        raise ValueError(f"group_size applies to int4 formats only; {fmt} takes group_size=None")


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of one layer's four projections as minillm stores them (fused qkv and gate/up)."""
    C, H, Hkv, D, F = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
    return [((H + 2 * Hkv) * D, C), (C, H * D), (2 * F, C), (C, F)]


def bits_per_weight(fmt: str, group_size: int | None = None, in_features: int | None = None) -> float:
    """Average stored bits per weight, metadata included. int8's per-row scale needs the row
    length `in_features` (K); without it the scale is left out (it is 32 / K bits)."""
    _check_format(fmt, group_size)
    bits, meta, where = FORMATS[fmt]
    if where == "group":
        return bits + meta / group_size
    if where == "row" and in_features is not None:
        return bits + meta / in_features
    return float(bits)


def format_bytes(n: int, k: int, fmt: str, group_size: int | None = None) -> int:
    """Bytes of one (N, K) weight stored as `fmt`, metadata included (a group size must divide K)."""
    _check_format(fmt, group_size)
    bits, meta, where = FORMATS[fmt]
    if where == "group" and k % group_size:
        raise ValueError(f"group_size={group_size} does not divide the input width {k}")
    groups = n * (k // group_size) if where == "group" else (n if where == "row" else 0)
    return (n * k * bits + groups * meta) // 8


def model_bytes(cfg: ModelConfig, fmt: str = "int4", group_size: int | None = 32,
                other_dtype: str = "fp32") -> dict:
    """{"projections", "embedding", "lm_head", "norms", "total"}: bytes of `cfg`'s weights with
    every projection in `fmt` and the rest in `other_dtype` (lm_head 0 when tied). The same
    counts `quant.api.quantized_bytes` makes on a real quantized model, for models nobody here
    can load (Llama-3-70B)."""
    group = group_size if FORMATS.get(fmt, (0, 0, None))[2] == "group" else None
    try:
        per_layer = sum(format_bytes(n, k, fmt, group) for n, k in projection_shapes(cfg))
    except ValueError as e:
        raise ValueError(f"{e} (model {cfg.name})") from None
    other = dtype_bytes(other_dtype)
    out = {"projections": cfg.n_layer * per_layer,
           "embedding": int(cfg.vocab_size * cfg.d_model * other),
           "lm_head": 0 if cfg.tie_embeddings else int(cfg.vocab_size * cfg.d_model * other),
           "norms": int((2 * cfg.n_layer + 1) * cfg.d_model * other)}
    out["total"] = sum(out.values())
    return out
