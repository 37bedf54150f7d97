"""Bytes of a model's weights per format, from its config alone (no weights needed).

Letters: N output rows, K inputs of a projection, G group size, C d_model, V vocab.

The same counts `quantized_bytes` makes on a real quantized model, as arithmetic, so a table
can cover models nobody here can load (Llama-3-70B): int8 per channel is K bytes plus one fp32
scale per row; int4 in groups of G is K/2 bytes plus two fp16 numbers (scale and minimum) per
group, i.e. 4 + 32/G bits per weight. The embedding, lm_head (when not tied) and the norms are
counted in `other_dtype`: `quantize` keeps them unquantized.

Left out on purpose: formats without a `quantize` method here (fp8, k-quants), activation and
KV-cache bytes (chapter 2's `kv_math`).
"""
from minillm.analysis.roofline import dtype_bytes

FLOAT_FORMATS = ("fp32", "bf16", "fp16")
FORMATS = (*FLOAT_FORMATS, "int8", "int4")


def projection_shapes(cfg) -> list[tuple[int, int]]:
    """(N, K) of one layer's fused projections: qkv, o, gate_up, down."""
    C, D = cfg.d_model, cfg.head_dim
    return [((cfg.n_head + 2 * cfg.n_kv_head) * D, C), (C, cfg.n_head * D),
            (2 * cfg.d_ff, C), (C, cfg.d_ff)]


def format_bytes(n: int, k: int, fmt: str, group_size: int | None = None) -> int:
    """Bytes of one (N, K) weight stored as `fmt` (int4 needs `group_size` dividing K)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt in FLOAT_FORMATS:
        return int(n * k * dtype_bytes(fmt))
    if fmt == "int8":
        return n * k + 4 * n
    if not isinstance(group_size, int) or group_size < 2 or k % group_size:
        raise ValueError(f"group_size must be an int >= 2 dividing {k} for int4, got {group_size!r}")
    return n * k // 2 + 2 * 2 * n * (k // group_size)


def model_bytes(cfg, fmt: str = "int4", group_size: int | None = 32,
                other_dtype: str = "fp32") -> dict:
    """{"projections", "embedding", "lm_head", "norms", "total"} bytes of `cfg`'s weights with
    every projection in `fmt` and the rest in `other_dtype` (lm_head 0 when tied)."""
    per_layer = sum(format_bytes(n, k, fmt, group_size if fmt == "int4" else None)
                    for n, k in projection_shapes(cfg))
    other = dtype_bytes(other_dtype)
    out = {"projections": cfg.n_layer * per_layer,
           "embedding": int(cfg.vocab_size * cfg.d_model * other),
           "lm_head": 0 if cfg.tie_embeddings else int(cfg.vocab_size * cfg.d_model * other),
           "norms": int((2 * cfg.n_layer + 1) * cfg.d_model * other)}
    out["total"] = sum(out.values())
    return out
