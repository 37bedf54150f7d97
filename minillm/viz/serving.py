"""Plots for the serving chapters. Each function takes engine traces / request metrics and returns
a matplotlib Figure (save it with `minillm.viz.plotting.save_figure`).

- `gantt_chart`: which request is in the batch at each step (prefill vs decode), one panel per run;
- `occupancy_plot`: sequences in the batch and KV blocks in use, per step;
- `latency_cdfs`: TTFT, TPOT and end-to-end latency CDFs, one line per run;
- `step_time_plot`: wall time of each step with its prefill tokens (the prefill stall);
- `step_cost_plot`: time of one forward against its new tokens, measured and the roofline floor;
- `tradeoff_plot`: TTFT of the long prompt vs p99 TPOT of the others, one point per chunk size;
- `throughput_bars`: tokens/s per method.
"""
import matplotlib.pyplot as plt
import numpy as np


def gantt_chart(traces: dict[str, list[dict]], max_requests: int = 64):
    """Rows = requests (in arrival order), columns = engine steps; colour = what the row computes:
    prefill, decode, or padding (a finished member of a static batch that still holds its row)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    colors = ["white", "#d9d9d9", "#9ecae1", "#08519c"]          # empty, padding, prefill, decode
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 2.6 * len(traces)), squeeze=False)
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        ids = sorted({r for rec in trace for r in rec["request_ids"]}, key=int)[:max_requests]
        row = {r: i for i, r in enumerate(ids)}
        grid = np.zeros((len(ids), len(trace)))
        for t, rec in enumerate(trace):
            pre = set(rec["prefill_request_ids"])
            for r in rec.get("padding_request_ids", []):
                grid[row[r], t] = 1
            for r in rec["request_ids"]:
                if r in row:
                    grid[row[r], t] = 2 if r in pre else 3
        ax.imshow(grid, aspect="auto", cmap=ListedColormap(colors), vmin=0, vmax=3,
                  interpolation="nearest")
        waste = int((grid == 1).sum())
        ax.set_title(f"{label}: {len(trace)} steps" + (f", {waste} padding row-steps" if waste else ""))
        ax.set_ylabel("request")
    axes[0, 0].legend(handles=[Patch(color=c, label=n) for c, n in
                               zip(colors[1:], ("padding", "prefill", "decode"))],
                      fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("engine step")
    fig.tight_layout()
    return fig


def occupancy_plot(traces: dict[str, list[dict]], num_blocks: int | None = None):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    for label, trace in traces.items():
        a.plot([r["num_seqs"] for r in trace], label=label, lw=1)
        b.plot([r["blocks_used"] for r in trace], label=label, lw=1)
    a.set(xlabel="engine step", ylabel="sequences in the batch", title="batch occupancy")
    b.set(xlabel="engine step", ylabel="KV blocks in use", title="KV cache use")
    if num_blocks:
        b.axhline(num_blocks, color="gray", ls="--", lw=0.8, label="pool size")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _cdf(ax, values, label):
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float))
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def latency_cdfs(runs: dict[str, list]):
    """runs: label -> list of RequestMetrics (or dicts with ttft/tpot/e2e in seconds)."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for label, metrics in runs.items():
        get = (lambda m, k: m[k]) if metrics and isinstance(metrics[0], dict) else getattr
        for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
            _cdf(ax, [get(m, key) for m in metrics], label)
    for ax, title in zip(axes, ("time to first token (s)", "time per output token (s)",
                                "end-to-end latency (s)")):
        ax.set(xlabel=title, ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def step_time_plot(traces: dict[str, list[dict]]):
    """Per-step wall time (ms) against step index, with the step's prefill tokens as bars.

    Every panel shares both scales (time on the left, prefill tokens on the right), so a 64-token
    chunk is drawn at a sixth of a 384-token prefill's height. Warm the model up before tracing:
    a first multi-token forward also pays one-time costs (e.g. weight packing)."""
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 2.4 * len(traces)), squeeze=False,
                             sharex=True, sharey=True)
    top = max([r["num_prefill_tokens"] for t in traces.values() for r in t] + [1])
    twins = []
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        ms = [1e3 * (r["t_end"] - r["t_start"]) for r in trace]
        ax.plot(ms, color="C0", lw=1)
        ax.set_ylabel("step time (ms)", color="C0")
        ax.set_ylim(bottom=0)
        ax.set_title(label)
        tw = ax.twinx()
        if twins:
            tw.sharey(twins[0])
        twins.append(tw)
        tw.bar(range(len(trace)), [r["num_prefill_tokens"] for r in trace], color="C1", alpha=0.35)
        tw.set_ylabel("prefill tokens", color="C1")
    twins[0].set_ylim(0, 1.05 * top)
    axes[-1, 0].set_xlabel("engine step")
    fig.tight_layout()
    return fig


def step_cost_plot(tokens, measured_ms, floor_ms, ridge_tokens: int | None = None):
    """Time of one forward against the new tokens it carries: measured (points) and the roofline's
    lower bound (line), with the ridge chunk size marked. Flat below the ridge (the weight read
    dominates), rising linearly above it (the FLOPs do)."""
    if not (len(tokens) == len(measured_ms) == len(floor_ms)) or not len(tokens):
        raise ValueError("tokens, measured_ms and floor_ms must be non-empty and of equal length")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(tokens, floor_ms, color="gray", lw=1.5, label="roofline floor (this machine)")
    ax.plot(tokens, measured_ms, "o-", color="C0", lw=1, label="measured forward")
    if ridge_tokens is not None:
        ax.axvline(ridge_tokens, color="C3", ls="--", lw=1, label=f"ridge: {ridge_tokens} tokens")
    ax.set(xlabel="new tokens in the step", ylabel="ms per forward", xscale="log", yscale="log",
           title="one step: its time against its new tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def tradeoff_plot(points: list[dict]):
    """points: dicts with 'label', 'long_ttft' (s) and 'p99_itl' (s) of the running requests."""
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for p in points:
        ax.scatter(1e3 * p["p99_itl"], 1e3 * p["long_ttft"])
        ax.annotate(p["label"], (1e3 * p["p99_itl"], 1e3 * p["long_ttft"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="p99 inter-token latency of running requests (ms)", ylabel="TTFT of the long prompt (ms)",
           title="chunk size: stall vs time to first token")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def throughput_bars(results: dict[str, float], unit: str = "tokens/s"):
    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(results)
    ax.barh(names, [results[n] for n in names], color=[f"C{i}" for i in range(len(names))])
    for i, n in enumerate(names):
        ax.text(results[n], i, f" {results[n]:.1f}", va="center", fontsize=8)
    ax.set_xlabel(unit)
    ax.invert_yaxis()
    fig.tight_layout()
    return fig
