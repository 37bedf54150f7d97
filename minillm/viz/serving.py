"""Plots for the serving chapters. Each function takes engine traces / request metrics and returns
a matplotlib Figure (save it with `minillm.viz.plotting.save_figure`).

- `gantt_chart`: which request is in the batch at each step (prefill vs decode), one panel per run;
- `occupancy_plot`: sequences in the batch and (optionally) the fraction of the KV pool booked, per step;
- `latency_cdfs`: TTFT, TPOT and end-to-end latency empirical CDFs (step functions), one per run;
- `load_sweep_plot`: latency percentiles against offered load (rows of `lab.workloads.load_sweep`);
- `step_time_plot`: wall time of each step with its prefill tokens (the prefill stall);
- `step_cost_plot`: time of one forward against its new tokens, measured and the roofline floor;
- `tradeoff_plot`: TTFT of the long prompt vs p99 TPOT of the others, one point per chunk size;
- `throughput_bars`: tokens/s per method;
- `priority_plot`: per-class TTFT percentiles under fcfs and priority, and tokens/s against the
  interactive P95 TPOT per token budget (a record of `python -m benchmarks priority`).
"""
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter
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


def occupancy_plot(traces: dict[str, list[dict]], num_blocks: int | dict[str, int] | None = None,
                   max_num_seqs: int | None = None):
    """Sequences in the batch per step; with `num_blocks` (one pool size, or one per run) a second
    panel shows the fraction of the KV pool each run has booked, so a pool that is far from
    full reads as such. Without `num_blocks` there is no memory panel."""
    pools = num_blocks if isinstance(num_blocks, dict) else {k: num_blocks for k in traces}
    memory = num_blocks is not None
    if memory and any(not isinstance(pools.get(k), int) or pools[k] < 1 for k in traces):
        raise ValueError(f"num_blocks must be an int >= 1 or a dict giving one per run, got {num_blocks!r}")
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(10 if memory else 6, 3.2), squeeze=False)
    a = axes[0, 0]
    for i, (label, trace) in enumerate(traces.items()):
        a.step(range(len(trace)), [r["num_seqs"] for r in trace], where="post", label=label, lw=1, color=f"C{i}")
    if max_num_seqs:
        a.axhline(max_num_seqs, color="gray", ls="--", lw=0.8, label="max_num_seqs")
    a.set(xlabel="engine step", ylabel="sequences in the batch", title="batch occupancy")
    a.set_ylim(bottom=0)
    a.legend(fontsize=8)
    if memory:
        b = axes[0, 1]
        for i, (label, trace) in enumerate(traces.items()):
            b.step(range(len(trace)), [r["blocks_used"] / pools[label] for r in trace], where="post",
                   label=f"{label} ({pools[label]} blocks)", lw=1, color=f"C{i}")
        b.axhline(1.0, color="gray", ls="--", lw=0.8)
        b.set(xlabel="engine step", ylabel="fraction of the KV pool booked", title="KV cache use",
              ylim=(0, 1.05))
        b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _cdf(ax, values, label):
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float))
    if len(v):   # an empirical CDF is a step function: it jumps by 1/n at each value
        ax.step(np.r_[v[0], v], np.r_[0.0, np.arange(1, len(v) + 1) / len(v)], where="post", label=label)


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


def load_sweep_plot(rows: list[dict], unit: str = "steps"):
    """TTFT and TPOT percentiles (p50, p90, p99) against offered load, in engine steps
    (`unit="steps"`) or milliseconds (`unit="ms"`, from the wall-clock columns)."""
    if unit not in ("steps", "ms"):
        raise ValueError(f"unit must be 'steps' or 'ms', got {unit!r}")
    suffix, scale = ("", 1.0) if unit == "steps" else ("_s", 1e3)
    loads = [r["load"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key, title in zip(axes, ("ttft", "tpot"), ("time to first token", "time per output token")):
        for p, ls in (("50", "-"), ("90", "--"), ("99", ":")):
            col = f"{key}_p{p}{suffix}"
            if col in rows[0]:
                ax.plot(loads, [scale * r[col] for r in rows], ls=ls, marker="o", ms=3, color="C0",
                        label=f"p{p}")
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="offered load (1 = every slot busy)", ylabel=f"{title} ({unit})", title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
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
    ax.set_xticks(list(tokens), [str(t) for t in tokens])   # plain numbers, not 4x10^2
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
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


def priority_plot(record: dict):
    """Left: TTFT p50 / p95 / p99 per class and policy (log scale). Right: one point per
    max_num_batched_tokens, output tokens/s against the interactive class's P95 TPOT, with the SLA."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels, x = [], 0
    for name in ("interactive", "batch"):
        for policy, color in (("fcfs", "#bdbdbd"), ("priority", "#08519c")):
            row = record["policies"][policy].get(name)
            if row is None:
                continue
            vals = [row[f"ttft_p{p}"] for p in (50, 95, 99)]
            ax.bar([x, x + 0.27, x + 0.54], vals, width=0.25, color=color,
                   label=policy if name == "interactive" else None)
            labels.append((x + 0.27, f"{name}\n{policy}"))
            x += 1
    ax.set_xticks([p for p, _ in labels], [n for _, n in labels])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s): p50, p95, p99")
    ax.legend()
    tun = record["tuning"]
    xs = [r["tpot_p95"] for r in tun["rows"]]
    ys = [r["tokens_per_s"] for r in tun["rows"]]
    bx.plot(xs, ys, "o-", color="#08519c")
    for r in tun["rows"]:
        bx.annotate(str(r["budget"]), (r["tpot_p95"], r["tokens_per_s"]), textcoords="offset points",
                    xytext=(4, 4))
    bx.axvline(tun["sla_tpot_p95"], color="#cb181d", ls="--", label="SLA (interactive P95 TPOT)")
    bx.set_xlabel("interactive P95 TPOT (s)")
    bx.set_ylabel("output tokens/s")
    bx.set_title(f"max_num_batched_tokens chosen: {tun['chosen']}")
    bx.legend()
    fig.tight_layout()
    return fig
