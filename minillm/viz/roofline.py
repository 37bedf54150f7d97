"""Figures for chapters 1-2. Each function takes numbers and returns a matplotlib `Figure`;
the notebooks show them inline and save them with `minillm.viz.plotting.save_figure`.

Letters: B batch, S context (tokens), P block size.
Left out on purpose: styling beyond what makes the figure readable.
"""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

from minillm.model.config import ModelConfig
from minillm.analysis.kv_math import Reservation, attention_variants, kv_cache_bytes, weight_bytes
from minillm.analysis.roofline import Hardware, OpCost, decode_costs, total_cost

GiB = 2**30


def _group(label: str) -> str:
    """A measured point's kind: the first word of a label such as "matmul B=4" or "step B=1"."""
    head, _, rest = label.partition(" ")
    return head if rest else "measured"


def plot_roofline(hardware, dtype="bf16", predicted=(), measured=(), title=None):
    """Log-log roofline of one or more `Hardware`, with points.

    predicted: (label, OpCost) pairs, drawn hollow (grey) on the first hardware's roof.
    measured: objects with .label, .intensity, .achieved (e.g. `MeasuredPoint`), drawn filled;
    colour and marker say the kind (the label's first word: "matmul", "step"), the text beside a
    point only the rest of its label, on a side of its own per kind so that labels do not overlap.
    The legend lists only what is drawn.
    """
    hws = [hardware] if isinstance(hardware, Hardware) else list(hardware)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = np.logspace(-1, 4, 200)
    for hw in hws:
        ys = [hw.attainable(x, dtype) for x in xs]
        line, = ax.plot(xs, ys, lw=2, label=f"{hw.name} {dtype} (ridge {hw.ridge(dtype):.0f})")
        ax.axvline(hw.ridge(dtype), color=line.get_color(), ls=":", lw=1)
    for label, cost in predicted:
        y = hws[0].attainable(cost.intensity, dtype)
        ax.scatter(cost.intensity, y, s=60, facecolors="none", edgecolors="0.35", lw=1.5, zorder=3)
        ax.annotate(label, (cost.intensity, y), textcoords="offset points", xytext=(7, -9),
                    ha="left", fontsize=7, color="0.35")
    if predicted:
        ax.scatter([], [], facecolors="none", edgecolors="0.35", label="predicted (on the roof)")
    groups = list(dict.fromkeys(_group(p.label) for p in measured))
    offsets = [((6, -4), "left"), ((-6, -4), "right"), ((6, 6), "left")]
    for gi, group in enumerate(groups):
        pts = [p for p in measured if _group(p.label) == group]
        color, marker = plt.cm.tab10(3 + gi), "sD^v"[gi % 4]
        ax.scatter([p.intensity for p in pts], [p.achieved for p in pts], s=40, color=color,
                   marker=marker, zorder=4, label=f"measured: {group}")
        xytext, ha = offsets[gi % len(offsets)]
        for p in pts:
            text = p.label.partition(" ")[2] or p.label
            ax.annotate(text, (p.intensity, p.achieved), textcoords="offset points",
                        xytext=xytext, ha=ha, fontsize=7, color=color)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="FLOP/s", title=title or "Roofline")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    return fig


def _plain_log_ticks(ax, xticks=None) -> None:
    """Label log axes with plain numbers ("5", "20", "1024"), never "6x10^0": the x axis at the
    given values, the y axis at 1, 2 and 5 per decade when it spans under two decades."""
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    if xticks is not None:
        ax.xaxis.set_major_locator(FixedLocator(list(xticks)))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
    lo, hi = ax.get_ylim()
    narrow = lo > 0 and hi / lo < 100
    ax.yaxis.set_minor_formatter(plain if narrow else NullFormatter())


def plot_decode_vs_batch(batches, predicted_s, measured_s=None, title=None, max_batch=None):
    """Decode step time vs batch: flat while weight reads dominate, then rising.

    max_batch: the largest batch whose KV cache fits (e.g. `plan_capacity(...).max_num_seqs`);
    larger batches are drawn grey, past a dotted line, as points no card of that size can run.
    """
    batches, pred = np.asarray(batches), np.asarray(predicted_s) * 1e3
    fits = np.ones(len(batches), bool) if max_batch is None else batches <= max_batch
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(batches[fits], pred[fits], "o-", label="roofline lower bound")
    if measured_s is not None:
        meas = np.asarray(measured_s) * 1e3
        ax.plot(batches[fits], meas[fits], "s--", label="measured")
    if not fits.all():
        ax.plot(batches[~fits], pred[~fits], "x:", color="0.6",
                label=f"KV does not fit (B > {max_batch})")
        ax.axvline(max_batch, color="0.6", ls=":", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="decode step time (ms)",
           title=title or "One decode step vs batch size")
    _plain_log_ticks(ax, xticks=batches)
    ax.legend()
    ax.grid(True, which="both", alpha=0.2)
    return fig


def plot_skinny_matmul(rows, times: dict, title=None):
    """Time of (rows, k) @ W^T per route (skinny_matmul_times) against the one-read bound."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (label, secs) in enumerate(times.items()):
        style = "k:" if label == "bound" else "os^dvp"[i % 6] + "-"
        ax.plot(rows, np.asarray(secs) * 1e3, style, label="one weight read (bound)" if label == "bound" else label)
    ax.set(xlabel="rows (tokens) multiplied by the weight", ylabel="ms per matmul", ylim=(0, None),
           title=title or "A few rows times a big weight")
    ax.legend()
    ax.grid(True, alpha=0.2)
    return fig


def plot_verify_cost(table: dict, title=None):
    """forward(N) / forward(1) against N from `lab.verify_cost.verify_table`: measured, the least
    the kernels allow (with the tolerance band above it), the roofline's ratio, and the ridge
    point in rows when it falls inside the plotted range."""
    rows = table["rows"]
    ns = [r["n"] for r in rows]
    least = np.array([r["least"] for r in rows])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(ns, [r["ratio"] for r in rows], "o-", label="measured forward(N) / forward(1)")
    ax.plot(ns, least, "s--", label="least these matmul kernels allow")
    ax.fill_between(ns, least, least * (1 + table["tolerance"]), alpha=0.15,
                    label=f"within {100 * table['tolerance']:.0f}% of the least")
    if "int8_least" in rows[0]:
        ax.plot(ns, [r["int8_least"] for r in rows], "^:", label="least through int8 dynamic matmuls")
    ax.plot(ns, [r["roofline"] for r in rows], "k-", lw=1, label="roofline")
    ridge = table["ridge_rows"]
    if ridge is not None and ridge <= max(ns):
        ax.axvline(ridge, color="0.5", ls=":", lw=1, label=f"ridge: {ridge} rows")
    ax.set(xscale="log", xlabel="new tokens N in one forward (128 cached)" if table.get("context") == 128
           else "new tokens N in one forward", ylabel="time / time of N = 1",
           title=title or "What a verify step of N tokens costs")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.2)
    return fig


def plot_decode_breakdown(parts: dict, title=None):
    """One horizontal bar: where a measured decode step's time goes (ms).

    With the keys of `decode_breakdown(..., matmul_s=...)` the unexplained part is drawn as
    "matmuls below the roof" and "everything else"; without them as one "overhead" piece.
    """
    keys = [("weights_s", "weight reads at the roof"), ("kv_s", "KV reads"),
            ("activations_s", "activations")]
    if "matmul_below_roof_s" in parts:
        keys += [("matmul_below_roof_s", "matmuls below the roof"), ("other_s", "everything else")]
    else:
        keys += [("overhead_s", "unexplained (overhead)")]
    fig, ax = plt.subplots(figsize=(7, 2.2))
    left = 0.0
    for key, label in keys:
        width = parts[key] * 1e3
        ax.barh([0], [width], left=left, label=f"{label}: {width:.2f} ms")
        left += width
    ax.set(yticks=[], xlabel="ms", title=title or "Where one decode step's time goes")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2)
    return fig


def plot_kv_variants(cfg: ModelConfig, num_tokens: int, dtype="bf16"):
    """KV bytes of one sequence of S tokens with MHA, the model's GQA, and MQA."""
    variants = attention_variants(cfg)
    vals = [kv_cache_bytes(c, num_tokens, 1, dtype) / GiB for c in variants.values()]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    bars = ax.bar([f"{k}\nHkv={c.n_kv_head}" for k, c in variants.items()], vals)
    ax.bar_label(bars, labels=[f"{v:.3f} GiB" for v in vals], fontsize=8)
    ax.set(ylabel="GiB", title=f"{cfg.name}: KV cache of {num_tokens} tokens ({dtype})")
    return fig


def plot_memory_vs_context(cfg: ModelConfig, contexts, batch_size=1, dtype="bf16",
                           memory_bytes=None):
    """Weights (flat) vs KV (linear in S) for B sequences as the context grows."""
    contexts = np.asarray(contexts)
    w = weight_bytes(cfg, dtype) / GiB
    kv = np.array([kv_cache_bytes(cfg, int(s), batch_size, dtype) for s in contexts]) / GiB
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(contexts, np.full(len(contexts), w), label="weights")
    ax.plot(contexts, kv, label=f"KV cache (B={batch_size})")
    ax.plot(contexts, w + kv, "k--", label="total")
    if memory_bytes:
        ax.axhline(memory_bytes / GiB, color="r", ls=":", label="device memory")
    ax.set(xscale="log", xlabel="context length S (tokens)", ylabel="GiB",
           title=f"{cfg.name} ({dtype}): weights vs KV cache")
    ax.legend()
    ax.grid(True, which="both", alpha=0.2)
    return fig


def plot_reservation_waste(reservations: list[Reservation], title=None):
    """Share of reserved KV slots left unused, per scheme (static, then block sizes)."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r.scheme.replace("block ", "P=") for r in reservations]
    vals = [100 * r.waste for r in reservations]
    bars = ax.bar(names, vals, color=["tab:red"] + ["tab:blue"] * (len(vals) - 1))
    ax.bar_label(bars, labels=[f"{v:.1f}" for v in vals], fontsize=7)
    ax.set(ylabel="reserved but unused (%)", ylim=(0, 105),
           title=title or "KV memory wasted: reserve max length vs allocate blocks")
    ax.tick_params(axis="x", labelsize=8)
    return fig


def predicted_decode_points(cfg: ModelConfig, batches, context_len: int = 0,
                            dtype="bf16") -> list[tuple[str, OpCost]]:
    """(label, total OpCost) of decode steps at each batch, for `plot_roofline(predicted=...)`."""
    return [(f"B={b}", total_cost(decode_costs(cfg, b, context_len, dtype))) for b in batches]
