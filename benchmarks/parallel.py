"""Chapter 11 benchmark: collectives and the pipeline bubble measured on this machine, and what the
same formulas predict for SmolLM2-135M at TP=3 here and for Llama-2-70B on H100s.

Three parts, one record (benchmarks/results/parallel_cpu.json):
- `collectives`: gloo all-reduce, all-gather and send between 2 processes at 4 payload sizes
  (medians), and the alpha-beta line fitted to each kind (`fit_alpha_beta`);
- `pipeline`: the real SmolLM2-135M split over 2 processes (`PipelineParallel`), 8 prompts of 32
  tokens, the bubble measured at m = 1, 2, 4, 8 micro-batches (median of the rounds) beside GPipe's
  (p-1)/(m+p-1), with each stage's busy seconds (the last stage carries lm_head, so an even split
  leaves the stages unequal and the formula low), the same with `balanced_partition`'s cut, the
  one-process forward of the same batch, and greedy decode ms per token (KV-cached, batch 4) for
  one process against the pipeline at m = 1 and 2: on one CPU a pipeline adds hops and buys nothing
  per token;
- `predicted`: the measured all-reduce line as a `Link`, so `tp_comm_time` predicts a TP=3
  decode step's collectives for SmolLM2 on this machine; and `tp_decode_split` for Llama-2-70B
  at TP 1/4/8 over NVLink, PCIe, 100 GbE and 10 GbE.

Timings on a shared 2-core machine move from run to run; the record keeps the load average.
Left out on purpose: tensor-parallel decode timings (the TP engine's own tests and chapter time
those), GPUs (gloo between CPU processes only).
"""
import os
import statistics
import time

import torch

from benchmarks.records import write_result
from minillm.analysis.parallel_math import tp_comm_time, tp_decode_split
from minillm.distributed.collectives import fit_alpha_beta, measure_collectives
from minillm.distributed.pipeline import PipelineParallel
from minillm.distributed.pipeline_stage import balanced_partition
from minillm.model.config import get_config
from minillm.model.generate import generate_batch
from minillm.model.loading import load_model

MICROBATCHES = (1, 2, 4, 8)
DECODE_TOKENS = 16


def _median_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collectives(repeats: int) -> dict:
    timings = measure_collectives(2, repeats=repeats)
    fits = fit_alpha_beta(timings)
    return {"world_size": 2, "repeats": repeats,
            "timings": [{"kind": t.kind, "bytes": t.nbytes, "median_ms": t.seconds_median * 1e3,
                         "min_ms": t.seconds_min * 1e3} for t in timings],
            "fits": {k: {"alpha_us": f.latency_s * 1e6, "GBps": 1e-9 / f.seconds_per_byte
                         if f.seconds_per_byte else None} for k, f in fits.items()}}, fits


def _pipeline(model, rounds: int, batch: int, tokens: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens),
                        generator=torch.Generator().manual_seed(0))              # (B, T)
    prompts = ids[:4, :16].tolist()                                              # decode: B=4
    rows = {m: [] for m in MICROBATCHES}
    decode = {"single": [], "p2_m1": [], "p2_m2": []}
    before = torch.get_num_threads()
    torch.set_num_threads(1)                      # the one-process reference gets one core too
    try:
        with PipelineParallel(model, pipeline_parallel_size=2, threads=1) as pp:
            pp.forward(ids[:1, :8])                                              # warm-up
            for _ in range(rounds):
                for m in MICROBATCHES:                                           # in turn
                    _, tl = pp.forward(ids, num_microbatches=m)
                    rows[m].append((tl.bubble_fraction(), tl.span(), tl.busy(0), tl.busy(1)))
                for name, fn in (("single", lambda: generate_batch(model, prompts, DECODE_TOKENS)),
                                 ("p2_m1", lambda: pp.generate(prompts, DECODE_TOKENS, 1)),
                                 ("p2_m2", lambda: pp.generate(prompts, DECODE_TOKENS, 2))):
                    t0 = time.perf_counter()
                    fn()
                    decode[name].append((time.perf_counter() - t0) / DECODE_TOKENS)
            single_forward = _median_time(lambda: model(ids), rounds)
        partition = balanced_partition(model.config, 2)
        balanced = {m: [] for m in MICROBATCHES}
        with PipelineParallel(model, 2, partition=partition, threads=1) as pp_balanced:
            pp_balanced.forward(ids[:1, :8])
            for _ in range(rounds):
                for m in MICROBATCHES:
                    _, tl = pp_balanced.forward(ids, num_microbatches=m)
                    balanced[m].append((tl.bubble_fraction(), tl.busy(0), tl.busy(1)))
    finally:
        torch.set_num_threads(before)
    return {"pipeline_parallel_size": 2, "batch": batch, "tokens": tokens, "rounds": rounds,
            "layers": [[r.start, r.stop] for r in pp.ranges],
            "single_process_forward_s": single_forward,
            "balanced": {"partition": partition, "by_microbatches": {str(m): {
                "bubble_measured": statistics.median(r[0] for r in rs),
                "busy_s": [statistics.median(r[1] for r in rs), statistics.median(r[2] for r in rs)]}
                for m, rs in balanced.items()}},
            "decode_ms_per_token": {k: statistics.median(v) * 1e3 for k, v in decode.items()},
            "decode_setup": {"batch": len(prompts), "prompt_tokens": len(prompts[0]),
                             "new_tokens": DECODE_TOKENS, "threads_per_stage": 1},
            "by_microbatches": {str(m): {
                "bubble_measured": statistics.median(r[0] for r in rs),
                "bubble_formula": 1 / (m + 1),
                "span_s": statistics.median(r[1] for r in rs),
                "busy_s": [statistics.median(r[2] for r in rs), statistics.median(r[3] for r in rs)]}
                for m, rs in rows.items()}}


def _predicted(fits) -> dict:
    smol, l70 = get_config("smollm2-135m"), get_config("llama-2-70b")
    here = fits["all_reduce"].as_link("this machine, gloo all-reduce fit")
    out = {"smollm2_tp3_decode_comm_ms": tp_comm_time(smol, 3, 1, here, dtype_bytes=4) * 1e3,
           "llama2_70b_decode_ms": {}}
    for link in ("nvlink4", "pcie4-x16", "100gbe", "10gbe"):
        out["llama2_70b_decode_ms"][link] = {
            str(tp): {"compute": s.compute_s * 1e3, "comm": s.comm_s * 1e3, "total": s.total_s * 1e3,
                      "fits": s.fits}
            for tp in (1, 4, 8) for s in [tp_decode_split(l70, tp, 1, link)]}
    return out


def run(quick: bool = False, device="cpu", out_dir=None, model=None) -> dict:
    """Measure, predict, and write benchmarks/results/parallel_cpu.json (CPU processes only)."""
    before = os.getloadavg()
    coll, fits = _collectives(repeats=5 if quick else 20)
    if model is None:
        model, _ = load_model(device="cpu")
    pipe = _pipeline(model, rounds=1 if quick else 3, batch=8, tokens=16 if quick else 32)
    payload = {"units": {"median_ms": "ms", "alpha_us": "us", "GBps": "GB/s", "span_s": "s",
                         "busy_s": "s", "bubble_measured": "fraction"},
               "load_average_before": [round(x, 2) for x in before],
               "collectives": coll, "pipeline": pipe, "predicted": _predicted(fits)}
    record = {"benchmark": "parallel", **payload}
    record["path"] = str(write_result("parallel", payload, device="cpu", out_dir=out_dir))
    return record


def report(record: dict) -> str:
    lines = ["collectives over 2 gloo processes (median ms by bytes):"]
    for t in record["collectives"]["timings"]:
        lines.append(f"  {t['kind']:10s} {t['bytes']:>8d} B  {t['median_ms']:.3f} ms")
    for k, f in record["collectives"]["fits"].items():
        lines.append(f"  fit {k}: alpha {f['alpha_us']:.0f} us")
    lines.append("pipeline p=2 bubble, measured vs (p-1)/(m+p-1):")
    for m, r in record["pipeline"]["by_microbatches"].items():
        lines.append(f"  m={m}: {r['bubble_measured']:.2f} vs {r['bubble_formula']:.2f} "
                     f"(busy {r['busy_s'][0]:.2f} / {r['busy_s'][1]:.2f} s)")
    bal = record["pipeline"]["balanced"]
    lines.append(f"balanced partition {bal['partition']}: " + ", ".join(
        f"m={m} {r['bubble_measured']:.2f}" for m, r in bal["by_microbatches"].items()))
    d = record["pipeline"]["decode_ms_per_token"]
    lines.append(f"one-process forward {record['pipeline']['single_process_forward_s']:.2f} s; decode "
                 f"ms/token: one process {d['single']:.0f}, p=2 m=1 {d['p2_m1']:.0f}, "
                 f"m=2 {d['p2_m2']:.0f}")
    p = record["predicted"]
    lines.append(f"SmolLM2 TP=3 decode collectives here: {p['smollm2_tp3_decode_comm_ms']:.1f} ms")
    for link, by_tp in p["llama2_70b_decode_ms"].items():
        lines.append(f"  70B {link:9s} " + "  ".join(f"tp{tp} {v['total']:.1f} ms"
                                                     for tp, v in by_tp.items()))
    return "\n".join(lines)
