"""Plots for the HTTP load generator (`minillm.lab.loadgen`; `python -m benchmarks serve`); each
returns a Figure.

- `serve_run_plot`: one run: TTFT, ITL and e2e empirical CDFs (ms) of the completed requests;
- `offered_load_plot`: one server swept over offered load: achieved rate, TTFT and TPOT p50 / p99
  against the OFFERED request rate, saturation marked (chapter 8's knee);
- `latency_vs_load_plot`: one or more servers swept over offered load (request rate):
  output tokens/s, TTFT p50/p99 and TPOT p50/p99 against the request rate each run achieved.

Left out on purpose: live dashboards (chapter 8's /metrics endpoint is for those).
"""
import math

import matplotlib.pyplot as plt
import numpy as np


def _cdf(ax, values_ms, label=None):
    v = np.sort(np.asarray([x for x in values_ms if not math.isnan(x)], dtype=float))
    if len(v):   # an empirical CDF is a step function: it jumps by 1/n at each value
        ax.step(np.r_[v[0], v], np.r_[0.0, np.arange(1, len(v) + 1) / len(v)], where="post", label=label)


def serve_run_plot(results, title: str = ""):
    """results: the RequestResult list of one run (failed ones are skipped)."""
    done = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    _cdf(axes[0], [1e3 * r.ttft for r in done])
    _cdf(axes[1], [1e3 * g for r in done for g in r.itl])
    _cdf(axes[2], [1e3 * r.e2e for r in done])
    for ax, name in zip(axes, ("time to first token (ms)", "inter-token latency (ms)",
                               "end-to-end latency (ms)")):
        ax.set(xlabel=name, ylabel="fraction")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def latency_vs_load_plot(sweeps: dict[str, list[dict]]):
    """sweeps: server label -> summaries (from `serve_metrics.summarize`) in order of offered
    load; x is the achieved request throughput, so saturation shows as points piling up."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for i, (label, rows) in enumerate(sweeps.items()):
        x = [r["request_throughput"] for r in rows]
        axes[0].plot(x, [r["output_throughput"] for r in rows], marker="o", color=f"C{i}", label=label)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            ax.plot(x, [r[key]["median"] for r in rows], marker="o", color=f"C{i}", label=f"{label} p50")
            ax.plot(x, [r[key]["p99"] for r in rows], marker="^", ls=":", color=f"C{i}",
                    label=f"{label} p99")
    for ax, name in zip(axes, ("output tokens/s", "TTFT (ms)", "TPOT (ms)")):
        ax.set(xlabel="achieved requests/s", ylabel=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def offered_load_plot(rows: list[dict], capacity: float, title: str = ""):
    """Latency against OFFERED load, one server: rows of {"offered_rate", "summary"} (rate inf
    allowed), capacity = the request rate achieved when everything was sent at once. Left: achieved
    against offered requests/s (the dashed diagonal is "every request offered is served at once",
    the dotted level is the capacity); middle and right: TTFT and TPOT p50 / p99 (ms). The run at
    rate inf is drawn at the right edge, at 1.5 x capacity, labelled "all at once"."""
    edge = 1.5 * capacity
    xs = [edge if math.isinf(r["offered_rate"]) else r["offered_rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    axes[0].plot([0, edge], [0, edge], ls="--", color="0.6", lw=1, label="served = offered")
    axes[0].axhline(capacity, ls=":", color="0.3", lw=1, label="capacity (all at once)")
    axes[0].plot(xs, [r["summary"]["request_throughput"] for r in rows], marker="o", color="C0",
                 label="achieved")
    for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
        ax.plot(xs, [r["summary"][key]["median"] for r in rows], marker="o", color="C0", label="p50")
        ax.plot(xs, [r["summary"][key]["p99"] for r in rows], marker="^", ls=":", color="C3", label="p99")
    for ax, name in zip(axes, ("achieved requests/s", "TTFT (ms)", "TPOT (ms)")):
        ax.axvline(capacity, color="0.8", lw=6, alpha=0.5, zorder=0)
        ticks = [x for x in xs if x != edge]
        ax.set_xticks(ticks + [edge])
        ax.set_xticklabels([f"{x:.2g}" for x in ticks] + ["all at\nonce"], fontsize=7)
        ax.set(xlabel="offered requests/s", ylabel=name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
