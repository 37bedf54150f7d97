"""The shipped GGUF file's Q4_1 blocks, read as they are: the model at 4 bits with nothing lost.

Letters: N output rows of a weight, K inputs, G = 32 weights per Q4_1 block, H / Hkv heads,
D head dim.

A Q4_1 block is 20 bytes for 32 weights of one row: fp16 `d`, fp16 `m`, then 16 bytes of codes
(weight j in the low nibble of byte j, weight j + 16 in the high one); a weight is `d * q + m`.
`gguf`'s `GGUFReader` gives each tensor's bytes; we decode them into `Int4Weight(group_size=32)`,
whose `dequantize()` equals minillm's fp32 weights bit for bit. The q and k rows that llama.cpp's
converter interleaved for RoPE are permuted back (whole rows, so blocks stay intact), and q, k, v
and gate, up are stacked into the fused projections. The norms (F32) and the token embedding
(Q8_0, tied to `lm_head`) stay as the fp32 model has them.

Left out on purpose: writing GGUF files, other block types (Q8_0, k-quants), other architectures.
"""
import functools
from pathlib import Path

import torch

from minillm.model.loading import smollm2_gguf_path
from minillm.quant.formats import Int4Weight

BLOCK = 32                 # weights per Q4_1 block
BLOCK_BYTES = 20           # 2 (d) + 2 (m) + 16 (32 four-bit codes)
PROJECTIONS = {"attn_output": "attn.o_proj", "ffn_down": "mlp.down_proj"}
FUSED = {"attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "mlp.gate_up_proj": ("ffn_gate", "ffn_up")}


def q4_1_layout() -> dict:
    """What one Q4_1 block holds, byte by byte."""
    return {"weights_per_block": BLOCK, "bytes_per_block": BLOCK_BYTES,
            "bits_per_weight": 8 * BLOCK_BYTES / BLOCK, "rule": "w = d * q + m, q in 0..15",
            "fields": [{"name": "d", "bytes": "0:2", "type": "fp16", "what": "scale (max - min) / 15"},
                       {"name": "m", "bytes": "2:4", "type": "fp16", "what": "the block's minimum"},
                       {"name": "qs", "bytes": "4:20", "type": "16 x uint8",
                        "what": "byte j: weight j in the low nibble, weight j + 16 in the high"}]}


def decode_q4_1(raw: torch.Tensor) -> Int4Weight:
    """Raw Q4_1 bytes (N, K/32 * 20) uint8 -> Int4Weight (N, K) with group_size 32."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % BLOCK_BYTES:
        raise ValueError(f"raw must be uint8 (N, K/32 * 20), got {raw.dtype} {tuple(raw.shape)}")
    N = raw.shape[0]
    blocks = raw.reshape(N, -1, BLOCK_BYTES)                                # (N, K/G, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]          # (N, K/G); little-endian
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]          # (N, K/G)
    qs = blocks[..., 4:]                                                    # (N, K/G, 16)
    q = torch.empty(N, blocks.shape[1], BLOCK, dtype=torch.uint8)           # (N, K/G, 32)
    torch.bitwise_and(qs, 0xF, out=q[..., :16])
    torch.bitwise_right_shift(qs, 4, out=q[..., 16:])
    return Int4Weight(q.view(N, -1), d, m, BLOCK)


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    """One parsed file per path (parsing the header and its 49k-token vocabulary takes seconds;
    the tensors stay memory-mapped)."""
    from gguf import GGUFReader
    return GGUFReader(path)


def read_tensors(path=None) -> dict:
    """name -> (type name, raw tensor) for every tensor of a GGUF file (default: the shipped one).
    Q4_1 tensors come back as uint8 (N, K/32 * 20); F32 ones as float32 arrays."""
    return {t.name: (t.tensor_type.name, torch.from_numpy(t.data.copy()))
            for t in _reader(_path(path)).tensors}


def read_config(path=None) -> dict:
    """The few llama.* fields the name and row mapping needs."""
    fields = _reader(_path(path)).fields

    def value(key):
        return int(fields[key].parts[-1][0])
    return {"n_layer": value("llama.block_count"), "n_head": value("llama.attention.head_count"),
            "n_kv_head": value("llama.attention.head_count_kv"),
            "d_model": value("llama.embedding_length"), "d_ff": value("llama.feed_forward_length")}


def tensor_types(path=None) -> dict:
    """type name -> {"count", "bytes", "example"}: what the file stores in which format."""
    out = {}
    for name, (kind, raw) in read_tensors(path).items():
        row = out.setdefault(kind, {"count": 0, "bytes": 0, "example": name})
        row["count"] += 1
        row["bytes"] += raw.numel() * raw.element_size()
    return out


def unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order on any (N, X) tensor of rows (raw blocks or weights):
    GGUF row h*D + 2i + p becomes row h*D + p*D/2 + i, minillm's "rotate half" order."""
    N = rows.shape[0]
    return rows.reshape(n_head, N // n_head // 2, 2, -1).transpose(1, 2).reshape(N, -1)  # (H, 2, D/2, X)


def gguf_weights(path=None) -> dict:
    """module name ("layers.0.attn.qkv_proj", ...) -> Int4Weight, for every projection. Rows
    are moved as whole raw blocks (permuted, stacked), then decoded once per module."""
    cfg, tensors = read_config(path), read_tensors(path)
    heads = {"attn_q": cfg["n_head"], "attn_k": cfg["n_kv_head"]}

    def raw(name):
        kind, data = tensors[f"{name}.weight"]
        if kind != "Q4_1":
            raise ValueError(f"{name}.weight is stored as {kind}; only Q4_1 projections are read")
        short = name.split(".")[2]
        return unpermute_rows(data, heads[short]) if short in heads else data  # (N, K/32 * 20)
    out = {}
    for i in range(cfg["n_layer"]):
        for gname, ours in PROJECTIONS.items():
            out[f"layers.{i}.{ours}"] = decode_q4_1(raw(f"blk.{i}.{gname}"))
        for ours, parts in FUSED.items():
            out[f"layers.{i}.{ours}"] = decode_q4_1(torch.cat([raw(f"blk.{i}.{p}") for p in parts]))
    return out


def _path(path) -> str:
    if path is None:
        path = smollm2_gguf_path()
    if not Path(path).is_file():
        raise FileNotFoundError(f"path must be a GGUF file, got {str(path)!r}")
    return str(Path(path).resolve())
