"""Chapter 9: attention's share of a real-model step at long context.

On SmolLM2-135M (`load_model()`, fp32) through the engine's `PagedKVCache`:
- decode, batch 1, context S: a full step (metadata + 30 layers + lm_head) with S tokens
  cached, and the attention part alone (the same metadata, then `attend_slot_rows` or
  `flash_decode` in each of the 30 layers); attention's share two ways: attention / step, and
  (step(S) - step(16)) / step(S), what the context adds;
- prefill of T tokens in one forward (no chunking): the same two timings.
The cache holds random K/V (the time of attention does not depend on the values); blocks are
a random permutation of the pool, as in a long-running engine.

Beside each measurement: chapter 2's ratio KV bytes / weight bytes at that context
(`kv_math`), and the roofline's predicted share (`roofline.step_costs`: attention's two matmuls
over the time of the whole step, with this machine's bandwidth and FLOP/s measured in the same
process). The roofline reads the KV once; the paged path gathers it first (read, write, read).

Left out on purpose: batch > 1 on the real model (the attention-alone table covers B 8), and
chunked prefill (each chunk is a prefill at a smaller T over a longer context).
"""
import statistics
import time

import torch

from minillm.analysis.kv_math import kv_bytes_per_token, weight_bytes
from minillm.analysis.roofline import decode_costs, op_time, prefill_costs, step_time
from minillm.attention.flash_decoding import DecodePlan, CHUNK, flash_decode
from minillm.attention.paged import attend_slot_rows
from minillm.paging.paged_cache import PagedKVCache

DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
PREFILL_LENGTHS = (128, 512, 1024, 2048, 4096)
BASE_CONTEXT = 16                       # the "no context" step that the others are compared with


def random_cache(model, max_tokens: int, backend: str = "paged", block_size: int = 16, seed: int = 0):
    """A PagedKVCache of ceil(max_tokens / P) blocks filled with random K/V (every page written,
    so reads are real memory reads) and one shuffled block table -> (cache, table)."""
    nb = -(-max_tokens // block_size)
    cache = PagedKVCache(model.config, nb, block_size, model.device, model.dtype,
                         attention_backend=backend)
    g = torch.Generator(device=model.device).manual_seed(seed)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    return cache, torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_and_attention(model, cache, table, T: int, S: int, backend: str):
    """(full step fn, attention-alone fn) for T new tokens ending at context S (batch 1)."""
    cfg, dev, P = model.config, model.device, cache.block_size
    ids = torch.ones(1, T, dtype=torch.long, device=dev)                      # (1, T)
    pos = torch.arange(S - T, S, device=dev)                                  # (T,)
    last = torch.tensor([T - 1], device=dev)
    rows = table[:-(-S // P)]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(cfg.n_head, T, cfg.head_dim, generator=g, dtype=model.dtype)   # (H, T, D)

    def step():
        cache.attention_backend = backend
        cache.prepare([T], [S], [rows])
        return model(ids, positions=pos, cache=cache, logits_index=last)

    def attention():
        meta = cache.prepare([T], [S], [rows])
        if backend == "flash_decoding" and T == 1:
            plan = DecodePlan.from_metadata(meta, cfg.n_kv_head, CHUNK, cfg.max_seq_len)
            for k, v in zip(cache._k_slots, cache._v_slots):
                flash_decode(q.transpose(0, 1), k, v, cfg.n_kv_head, plan)
        else:
            for k, v in zip(cache._k_slots, cache._v_slots):
                attend_slot_rows(q.transpose(0, 1), k, v, cfg.n_kv_head, meta)
    return step, attention


def predicted_share(costs, hw, dtype="fp32") -> float:
    """The roofline's share of attention's two matmuls in a step's lower-bound time."""
    attn = sum(op_time(c, hw, dtype) for c in costs if c.name.startswith("attn"))
    return attn / step_time(costs, hw, dtype)


@torch.inference_mode()
def run_long_context(model, hw, decode_contexts=DECODE_CONTEXTS, prefill_lengths=PREFILL_LENGTHS,
                     backends=("paged", "flash_decoding"), rounds: int = 3, repeat: int = 3) -> dict:
    """Decode rows (both backends, interleaved rounds) and prefill rows (paged, one round)."""
    cfg = model.config
    top = max([*decode_contexts, *prefill_lengths])
    cache, table = random_cache(model, top)
    kv_ratio = lambda n: kv_bytes_per_token(cfg, "fp32") * n / weight_bytes(cfg, "fp32")
    cases = {(S, b): _step_and_attention(model, cache, table, 1, S, b)
             for S in (BASE_CONTEXT, *decode_contexts) for b in backends}
    samples = {key: ([], []) for key in cases}
    for _ in range(rounds):
        for key, (step, attention) in cases.items():
            samples[key][0].append(_timed(step, repeat))
            samples[key][1].append(_timed(attention, repeat))
    med = {key: (statistics.median(a), statistics.median(b)) for key, (a, b) in samples.items()}
    decode = []
    for S in decode_contexts:
        row = {"context": S, "kv_over_weight_bytes": kv_ratio(S),
               "roofline_share": predicted_share(decode_costs(cfg, 1, S, "fp32"), hw)}
        for b in backends:
            step_s, attn_s = med[S, b]
            row[b] = {"step_ms": 1e3 * step_s, "attention_ms": 1e3 * attn_s,
                      "share": attn_s / step_s,
                      "share_by_difference": (step_s - med[BASE_CONTEXT, b][0]) / step_s}
        decode.append(row)
    prefill = []
    for T in prefill_lengths:
        step, attention = _step_and_attention(model, cache, table, T, T, "paged")
        n = repeat if T <= 1024 else 1
        step_s, attn_s = _timed(step, n), _timed(attention, n)
        prefill.append({"tokens": T, "step_ms": 1e3 * step_s, "attention_ms": 1e3 * attn_s,
                        "share": attn_s / step_s, "kv_over_weight_bytes": kv_ratio(T),
                        "roofline_share": predicted_share(prefill_costs(cfg, T, 1, "fp32"), hw)})
    return {"decode": decode, "prefill": prefill, "base_context": BASE_CONTEXT,
            "crossover_tokens": weight_bytes(cfg, "fp32") / kv_bytes_per_token(cfg, "fp32"),
            "hardware": {"name": hw.name, "mem_bandwidth": hw.mem_bandwidth,
                         "peak_flops": dict(hw.peak_flops)}}


def long_context_table(record: dict) -> str:
    """Decode and prefill rows as text (the flash-decoding columns when they were measured)."""
    fd = "flash_decoding" in record["decode"][0]
    lines = [f"decode, batch 1 (KV passes the weights at {record['crossover_tokens']:.0f} tokens):",
             f"{'S':>5} {'KV/W':>5} {'step ms':>8} {'attn ms':>8} {'share':>6} {'by diff':>7} "
             + (f"{'fd step':>8} {'fd share':>8} " if fd else "") + f"{'roofline':>8}"]
    for r in record["decode"]:
        p, f = r["paged"], r.get("flash_decoding")
        lines.append(f"{r['context']:>5} {r['kv_over_weight_bytes']:>5.2f} {p['step_ms']:>8.1f} "
                     f"{p['attention_ms']:>8.1f} {p['share']:>6.2f} {p['share_by_difference']:>7.2f} "
                     + (f"{f['step_ms']:>8.1f} {f['share']:>8.2f} " if fd else "")
                     + f"{r['roofline_share']:>8.2f}")
    lines.append("prefill (one forward of T tokens, paged):")
    lines.append(f"{'T':>5} {'step ms':>9} {'attn ms':>9} {'share':>6} {'roofline':>8}")
    extra = record.get("prefill_extra", [])          # rows run on their own (marked *)
    for r in record["prefill"] + extra:
        lines.append(f"{r['tokens']:>5} {r['step_ms']:>9.1f} {r['attention_ms']:>9.1f} "
                     f"{r['share']:>6.2f} {r['roofline_share']:>8.2f}" + (" *" if r in extra else ""))
    if extra:
        lines.append("* " + extra[0].get("note", "run separately"))
    return "\n".join(lines)
