"""Figures for chapter 11 (past one machine). Each function takes numbers and returns a Figure.

`plot_pipeline_timeline` draws a `PipelineTimeline` as a Gantt chart: one row per stage, one bar
per micro-batch, the idle gaps being the bubble. `plot_tp_decode_split` stacks a TP decode step's
compute and communication time (`TPSplit` rows from `minillm.analysis.parallel_math`), grouped
by link. `plot_collective_timings` draws measured collective times against payload size with
the fitted alpha-beta lines.

Left out on purpose: styling beyond what makes the figure readable.
"""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch


def plot_pipeline_timeline(timeline, title: str | None = None):
    """Gantt chart of a pipelined forward: stage s on row s, micro-batch i as bar i (ms)."""
    p, m = timeline.pipeline_parallel_size, timeline.num_microbatches
    fig, ax = plt.subplots(figsize=(7.5, 0.7 * p + 1.6))
    colors = plt.get_cmap("tab10")
    for s, i, a, b in timeline.rows():
        ax.barh(s, (b - a) * 1e3, left=a * 1e3, height=0.6, color=colors(i % 10),
                edgecolor="black", lw=0.5)
        ax.text((a + b) / 2 * 1e3, s, str(i), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"p={p}, m={m}: bubble measured {timeline.bubble_fraction():.2f}, "
                          f"(p-1)/(m+p-1) = {timeline.expected_bubble():.2f}")
    fig.tight_layout()
    return fig


def plot_tp_decode_split(rows, title: str | None = None):
    """Stacked bars of compute and communication per decode step (ms), one bar per (link, tp);
    bars whose weights do not fit one chip are hatched."""
    rows = list(rows)
    if not rows:
        raise ValueError("rows must hold at least one TPSplit")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    x = np.arange(len(rows))
    compute = [r.compute_s * 1e3 for r in rows]
    comm = [r.comm_s * 1e3 for r in rows]
    hatch = ["//" if not r.fits else "" for r in rows]
    ax.bar(x, compute, color="tab:blue", hatch=hatch)
    ax.bar(x, comm, bottom=compute, color="tab:orange")
    handles = [Patch(color="tab:blue", label="compute (roofline / tp)"),
               Patch(color="tab:orange", label="collectives"),
               Patch(facecolor="white", edgecolor="black", hatch="//",
                     label="weights do not fit one chip")]
    ax.set_xticks(x, [f"{r.link.split(' (')[0]}\ntp={r.tp}" for r in rows], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.legend(handles=handles)
    ax.set_title(title or f"{rows[0].model} decode, batch {rows[0].batch}, on {rows[0].chip}")
    fig.tight_layout()
    return fig


def plot_collective_timings(timings, fits=None, title: str | None = None):
    """Measured median seconds against payload bytes (log-log), per kind; with `fits` (from
    `fit_alpha_beta`) the fitted lines alpha + beta * nbytes."""
    timings = list(timings)
    if not timings:
        raise ValueError("timings must hold at least one CollectiveTiming")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for kind in sorted({t.kind for t in timings}):
        pts = sorted((t.nbytes, t.seconds_median) for t in timings if t.kind == kind)
        xs, ys = zip(*pts)
        line, = ax.plot(xs, np.array(ys) * 1e3, "o", label=kind)
        if fits and kind in fits:
            grid = np.logspace(np.log10(min(xs)), np.log10(max(xs)), 50)
            ax.plot(grid, [fits[kind].seconds(g) * 1e3 for g in grid], "-",
                    color=line.get_color(), lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("ms (median)")
    ax.legend()
    ax.set_title(title or f"collectives over {timings[0].world_size} processes (gloo)")
    fig.tight_layout()
    return fig
