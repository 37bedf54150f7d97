"""Benchmark for chapter 1: this machine's ceilings, matmul and real decode points on its roofline.

`python -m benchmarks roofline` (or `python -m benchmarks.roofline [--quick]`) measures
bandwidth and matmul FLOP/s, times decode- and prefill-shaped matmuls of SmolLM2's MLP
(d -> 2 d_ff), times real decode steps of SmolLM2-135M at several batch sizes B with S cached
tokens, and writes benchmarks/results/roofline_<device>.json plus two figures beside it.
Every measured time is reported with its roofline lower bound and the ratio measured/predicted.

Left out on purpose: repeated runs and confidence intervals (medians of a few repeats only).
"""
import os
import sys
from pathlib import Path

import torch

from benchmarks.records import save_figure_beside, write_result
from minillm.viz.plotting import use_headless_backend
from minillm.analysis.roofline import decode_costs, step_time, total_cost
from minillm.lab.measure import (decode_breakdown, matmul_points, measure_decode_steps,
                                      measure_hardware)


def run(quick: bool = False, device=None, out_dir=None,
        num_threads: int | None = None, model=None) -> dict:
    """Measure, compare with the roofline, write JSON + figures; returns the JSON dict.

    num_threads: CPU threads for torch (default: torch's own choice). On a machine shared with
    other jobs, 1 gives steadier numbers: OpenMP threads that wait on busy cores spin.
    model: an fp32 model of SmolLM2's shape to time instead of the real one (random weights).
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    from minillm.model.loading import default_device, load_model
    from minillm.viz.roofline import plot_decode_vs_batch, plot_roofline
    device = torch.device(device) if device is not None else default_device()
    use_headless_backend()
    hw = measure_hardware(device, quick=quick)
    if model is None:                               # fp32, like every chapter
        model, _ = load_model(device=device)
    cfg, dt, S = model.config, "fp32", 128
    points = matmul_points(hw, cfg.d_model, 2 * cfg.d_ff, batches=(1, 4, 16, 64, 256),
                           prefill_tokens=(1024,) if quick else (512, 2048), dtype=dt,
                           device=device, quick=quick)
    batches = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32, 64)
    measured = measure_decode_steps(model, batches, S, repeats=2 if quick else 3)
    predicted = [step_time(decode_costs(cfg, b, S, dt), hw, dt) for b in batches]
    parts = decode_breakdown(cfg, hw, 1, S, measured[0], dt)
    result = {
        "quick": quick, "load_avg_1min": os.getloadavg()[0],
        "units": {"peak_flops": "FLOP/s", "mem_bandwidth": "bytes/s", "mem_bytes": "bytes",
                  "flops": "FLOPs", "bytes": "bytes", "seconds": "s", "predicted_s": "s",
                  "measured_s": "s per decode step (median)", "ratio": "measured / predicted",
                  "context_len": "tokens", "batches": "sequences per decode step",
                  "decode_breakdown_b1": "s per batch-1 decode step",
                  "load_avg_1min": "runnable processes, 1-minute average"},
        "hardware": {"name": hw.name, "peak_flops": hw.peak_flops,
                     "mem_bandwidth": hw.mem_bandwidth, "mem_bytes": hw.mem_bytes},
        "matmul_points": [{"label": p.label, "flops": p.flops, "bytes": p.bytes,
                           "seconds": p.seconds, "predicted_s": p.predicted_s,
                           "ratio": p.ratio} for p in points],
        "decode": {"model": cfg.name, "dtype": dt, "context_len": S, "batches": list(batches),
                   "measured_s": measured, "predicted_s": predicted,
                   "ratio": [m / p for m, p in zip(measured, predicted)]},
        "decode_breakdown_b1": parts,
    }
    path = write_result("roofline", result, device=device, out_dir=out_dir)
    dec_pts = [(f"B={b}", total_cost(decode_costs(cfg, b, S, dt))) for b in batches]
    fig = plot_roofline(hw, dt, predicted=dec_pts, measured=points,
                        title=f"{hw.name}: matmuls (squares) and SmolLM2 decode (circles)")
    save_figure_beside(fig, path, "roofline")
    fig = plot_decode_vs_batch(batches, predicted, measured, title=f"SmolLM2 decode, S={S}")
    save_figure_beside(fig, path, "roofline_decode")
    _report(result, path)
    return result


def _report(result: dict, path: Path) -> None:
    hw = result["hardware"]
    print(f"{hw['name']}: {hw['mem_bandwidth'] / 1e9:.1f} GB/s, "
          + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in hw["peak_flops"].items()))
    for p in result["matmul_points"]:
        print(f"  matmul {p['label']:>14}: {p['seconds'] * 1e3:8.3f} ms, "
              f"measured/predicted {p['ratio']:.2f}")
    d = result["decode"]
    for b, m, r in zip(d["batches"], d["measured_s"], d["ratio"]):
        print(f"  decode B={b:<3} S={d['context_len']}: {m * 1e3:8.2f} ms, "
              f"measured/predicted {r:.2f}")
    print(f"wrote {path}")


def main(args=None) -> dict:
    args = sys.argv[1:] if args is None else args
    threads = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--threads=")), None)
    return run(quick="--quick" in args, num_threads=threads)


if __name__ == "__main__":
    main()
