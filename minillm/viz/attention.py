"""Figures for chapter 9 (attention at long context). Each function takes the numbers a cell
measured (or a committed record's rows) and returns a Figure; `plotting.save_figure` writes it.

Letters: N sequence length (prefill, T = S = N), S cached context (decode), B batch.
Left out on purpose: error bars (the chapter prints the medians it plots).
"""
import matplotlib.pyplot as plt

MiB = 2 ** 20


def _label(ax, xlabel: str, ylabel: str, title: str | None = None) -> None:
    """The axes' labels, a light grid on both tick levels and a small legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_peak_memory(ns, dense_bytes, tiled_bytes, record_points=None):
    """Peak extra memory of one attention call against N, log-log: dense (the N x N scores) and
    tiled. A slope-2 and a slope-1 guide through the first point show O(N^2) and O(N).
    record_points: optional [(N, dense_bytes, tiled_bytes)] from a committed record, drawn hollow."""
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    ax.loglog(ns, [b / MiB for b in dense_bytes], "o-", color="tab:red", label="dense (materialized)")
    ax.loglog(ns, [b / MiB for b in tiled_bytes], "s-", color="tab:blue", label="tiled (FlashAttention)")
    n0, d0, t0 = ns[0], dense_bytes[0] / MiB, tiled_bytes[0] / MiB
    span = [n0, max(ns) * (2 if record_points else 1)]
    ax.loglog(span, [d0 * (n / n0) ** 2 for n in span], ":", color="tab:red", lw=1, label="slope 2: N^2")
    ax.loglog(span, [t0 * (n / n0) for n in span], ":", color="tab:blue", lw=1, label="slope 1: N")
    if record_points:
        rn, rd, rt = zip(*record_points)
        ax.loglog(rn, [b / MiB for b in rd], "o", mfc="none", color="tab:red", label="committed record")
        ax.loglog(rn, [b / MiB for b in rt], "s", mfc="none", color="tab:blue")
    ticks = sorted({*ns, *(n for n, _, _ in record_points or [])})
    ax.set_xticks(ticks, [f"{n:,}" for n in ticks], fontsize=8)
    ax.xaxis.set_minor_locator(plt.NullLocator())
    _label(ax, "sequence length N (tokens)", "peak extra memory (MiB)",
           "one layer's attention (9 heads, fp32, causal)")
    fig.tight_layout()
    return fig


def plot_decode_attention(rows, record_rows=None):
    """Decode attention time of one layer against the context S, one panel per batch size:
    paged (gather + SDPA), flash-decoding and SDPA over a contiguous cache. rows: `run_decode`'s
    rows; record_rows: the same from a committed record, drawn dashed."""
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 3.6), squeeze=False)
    styles = {"paged": ("tab:red", "paged (gather, then SDPA)"),
              "flashdec": ("tab:green", "flash-decoding"),
              "sdpa": ("tab:gray", "SDPA, contiguous cache")}
    for ax, B in zip(axes[0], batches):
        for sources, ls, tag in ((rows, "-", ""), (record_rows or [], "--", " (record)")):
            mine = sorted((r for r in sources if r["batch"] == B), key=lambda r: r["context"])
            if not mine:
                continue
            for name, (color, label) in styles.items():
                ax.loglog([r["context"] for r in mine], [r[f"{name}_ms"] for r in mine], ls,
                          marker="o" if not tag else None, color=color, label=label + tag,
                          alpha=1.0 if not tag else 0.6)
        _label(ax, "context S (tokens)", "ms per layer", f"batch {B}")
    fig.tight_layout()
    return fig


def plot_attention_share(decode_rows, record_rows=None):
    """Attention's share of a batch-1 decode step against the context: measured (attention alone
    / step) and the roofline's prediction. decode_rows: `run_long_context(...)["decode"]`;
    record_rows: the same from a committed record, drawn dashed."""
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for rows, ls, tag, alpha in ((decode_rows, "-", "", 1.0), (record_rows or [], "--", " (record)", 0.6)):
        if not rows:
            continue
        s = [r["context"] for r in rows]
        ax.semilogx(s, [r["paged"]["share"] for r in rows], ls, marker="o", color="tab:red",
                    alpha=alpha, label="measured, paged" + tag)
        ax.semilogx(s, [r["roofline_share"] for r in rows], ls, marker="^", color="tab:blue",
                    alpha=alpha, label="roofline prediction" + tag)
    ax.axhline(0.5, color="k", lw=0.6, ls=":")
    ax.set_ylim(0, 1)
    _label(ax, "context S (tokens)", "attention / decode step", "SmolLM2-135M, batch 1, fp32")
    fig.tight_layout()
    return fig
