"""Chapter 9: decode attention alone at long context, three ways, in one process.

One layer of SmolLM2-135M's shape (H 9, Hkv 3, D 64), B sequences of S cached tokens each, one
new query per sequence:
- "paged": the engine's gather path, `attend_slot_rows` (gather through the block table, then SDPA);
- "flashdec": `flash_decode` over the same slot rows (chunks merged by log-sum-exp);
- "sdpa": `F.scaled_dot_product_attention` over a contiguous cache (B, Hkv, S, D), as `KVCache`
  attends: the floor a paged layout pays its gather against.
The block tables are a random permutation of the pool, as in a long-running engine. Variants
run in interleaved rounds (every point and variant once per round), so the bandwidth drift of a
shared machine spreads over all of them; the record keeps per-round medians and the ratios
paged/sdpa and flashdec/sdpa taken within each round.

`run_decode(...)` returns the table; the benchmark (`python -m benchmarks attention_decode`) adds
the real model's step shares (`long_context.py`) and writes both.
Left out on purpose: ragged batches (SDPA over a contiguous cache has one length) and
quantized KV.
"""
import statistics

import torch
import torch.nn.functional as F

from minillm.attention.backends import decode_step, decode_threshold
from minillm.attention.flash_decoding import CHUNK
from minillm.lab.common import time_fn

CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
BATCHES = (1, 8)
VARIANTS = ("paged", "flashdec", "sdpa")


def decode_point(B: int, S: int, H: int = 9, Hkv: int = 3, D: int = 64, block_size: int = 16,
                 chunk: int = CHUNK, dtype=torch.float32, seed: int = 0) -> dict:
    """Inputs of one (B, S) point and a zero-argument function per variant -> {name: fn}: the
    engine's two paths over shuffled paged pools (`backends.decode_step`, every sequence S
    long) and SDPA over a contiguous cache of the same shape."""
    step = decode_step(H, Hkv, D, B, S, dtype, seed=seed, context_lens=[S] * B,
                       block_size=block_size, chunk=chunk)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)                  # (B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    q4 = step["q"][:, :, None]                                               # (B, H, 1, D)
    return {"paged": step["paged"], "flashdec": step["flash_decoding"],
            "sdpa": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)}


def check_point(fns: dict, atol: float = 1e-4) -> None:
    """The paged and flash-decoding outputs agree (the contiguous cache holds other values)."""
    a, b = fns["paged"](), fns["flashdec"]()                                 # (B, H, D) each
    if a.shape != b.shape:
        raise AssertionError(f"paged attention gave {tuple(a.shape)}, flash_decode {tuple(b.shape)}")
    if not torch.allclose(a, b, atol=atol, rtol=0):
        raise AssertionError(f"flash_decode differs from paged attention by {(a - b).abs().max()}")


@torch.inference_mode()
def run_decode(contexts=CONTEXTS, batches=BATCHES, rounds: int = 3, repeat: int = 3,
               chunk: int = CHUNK, block_size: int = 16, num_threads: int | None = None) -> dict:
    """Time the three variants at every (B, S); returns rows with median ms and median ratios."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    points = {(B, S): decode_point(B, S, block_size=block_size, chunk=chunk)
              for B in batches for S in contexts}
    for fns in points.values():
        check_point(fns)
    samples = {key: {name: [] for name in VARIANTS} for key in points}
    for fns in points.values():                     # one untimed pass: the first call of a path
        for name in VARIANTS:                       # (allocations, lazy setup) is not its speed
            fns[name]()
    for _ in range(rounds):
        for key, fns in points.items():
            for name in VARIANTS:
                samples[key][name].append(time_fn(fns[name], warmup=1, repeat=repeat))
    threshold = decode_threshold(9, 3, 64)          # "auto"'s crossover here (cached, or timed now)
    rows = []
    for (B, S), s in samples.items():
        row = {"batch": B, "context": S}
        row.update({f"{n}_ms": 1e3 * statistics.median(s[n]) for n in VARIANTS})
        for n in ("paged", "flashdec"):
            row[f"{n}_over_sdpa"] = statistics.median(a / b for a, b in zip(s[n], s["sdpa"]))
        flash = threshold is not None and S > chunk and B * S >= threshold
        row["auto_backend"] = "flash_decoding" if flash else "paged"
        row["auto_over_sdpa"] = row["flashdec_over_sdpa" if flash else "paged_over_sdpa"]
        rows.append(row)
    return {"rows": rows, "auto_threshold_keys": threshold, "rounds": rounds, "repeat": repeat,
            "chunk": chunk,
            "block_size": block_size, "torch_threads": torch.get_num_threads(),
            "shape": {"H": 9, "Hkv": 3, "D": 64, "dtype": "fp32"}}


def decode_table(record: dict) -> str:
    """The rows as a text table."""
    auto = "auto_over_sdpa" in record["rows"][0]
    lines = [f"{'B':>2} {'S':>5} {'paged ms':>9} {'flashdec ms':>11} {'sdpa ms':>8} "
             f"{'paged/sdpa':>10} {'flashdec/sdpa':>13}" + ("   auto/sdpa (path)" if auto else "")]
    for r in record["rows"]:
        lines.append(f"{r['batch']:>2} {r['context']:>5} {r['paged_ms']:>9.3f} "
                     f"{r['flashdec_ms']:>11.3f} {r['sdpa_ms']:>8.3f} {r['paged_over_sdpa']:>10.2f} "
                     f"{r['flashdec_over_sdpa']:>13.2f}"
                     + (f"   {r['auto_over_sdpa']:>9.2f} ({r['auto_backend']})" if auto else ""))
    if auto:
        lines.append(f'"auto" uses flash-decoding from {record.get("auto_threshold_keys")} keys '
                     f"(batch x context) on this machine (None: never)")
    return "\n".join(lines)
