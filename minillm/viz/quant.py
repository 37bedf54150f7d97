"""Figures for chapter 7 (7 and 7b): the quantized roofline per format, the quality of each method,
the K/V error per cache format and the outlier census per layer. Each returns a Figure.

Letters: L layers.
"""
import matplotlib.pyplot as plt

from minillm.quant.targets import PROJECTIONS


def plot_quant_roofline(rows: dict):
    """{format: {"mb": MB read per step, "floor_ms": bytes / bandwidth, "ms": measured}} -> two
    panels: the MB each format reads per decode step, and its floor beside the measured time."""
    names = list(rows)
    xs = range(len(names))
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 3.4))
    ax_b.bar(xs, [rows[n]["mb"] for n in names], color="tab:gray")
    ax_b.set_ylabel("MB read per step")
    ax_b.set_title("bytes of weights a decode step reads")
    w = 0.38
    ax_t.bar([x - w / 2 for x in xs], [rows[n]["floor_ms"] for n in names], w,
             label="floor: bytes / read bandwidth", color="tab:blue")
    ax_t.bar([x + w / 2 for x in xs], [rows[n]["ms"] for n in names], w,
             label="measured", color="tab:orange")
    ax_t.set_ylabel("ms per step (one token)")
    ax_t.set_title("the floor and the measured step")
    ax_t.legend(fontsize=8)
    for ax in (ax_b, ax_t):
        ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
    fig.tight_layout()
    return fig


def plot_quality(rows: list[dict]):
    """`quality.compare` rows -> perplexity and KL divergence to the reference, one bar per method
    (the reference's perplexity as a dashed line; KL on a log scale, the reference's 0 left out)."""
    ref = rows[0]
    fig, (ax_p, ax_k) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [r["model"] for r in rows]
    ax_p.bar(range(len(rows)), [r["ppl"] for r in rows], color="tab:blue")
    ax_p.axhline(ref["ppl"], color="k", ls="--", lw=1, label=f"{ref['model']}")
    ax_p.set_ylabel("perplexity (lower is better)")
    ax_p.set_title("perplexity on the evaluation text")
    ax_p.legend(fontsize=8)
    rest = [r for r in rows[1:] if r["kl"] > 0]
    ax_k.bar(range(len(rest)), [r["kl"] for r in rest], color="tab:red")
    ax_k.set_yscale("log")
    ax_k.set_ylabel("KL(fp32 || quantized), nats per token")
    ax_k.set_title("how far each next-token distribution moved")
    ax_p.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax_k.set_xticks(range(len(rest)), [r["model"] for r in rest], rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    return fig


def plot_kv_error(err: dict):
    """{(tensor "K"/"V", format label): relative rms error} -> grouped bars, K and V per format."""
    kinds = list(dict.fromkeys(k for _, k in err))
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    w = 0.38
    for j, name in enumerate(("K", "V")):
        xs = [i + (j - 0.5) * w for i in range(len(kinds))]
        ax.bar(xs, [100 * err[(name, k)] for k in kinds], w, label=name)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("relative rms error (%)")
    ax.set_title("what each cache format loses on the model's own K and V")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_outliers(rows: list[dict], threshold: float = 6.0):
    """`outlier_features` rows -> two panels over the L layers: how many input dims of each
    projection reach the threshold, and the fraction of tokens where at least one does."""
    layers = sorted({r["layer"] for r in rows})
    fig, (ax_n, ax_f) = plt.subplots(1, 2, figsize=(11, 3.2))
    width = 0.8 / len(PROJECTIONS)
    for k, p in enumerate(PROJECTIONS):
        by_layer = {r["layer"]: r for r in rows if r["proj"] == p}
        xs = [layer + (k - 1.5) * width for layer in layers]
        ax_n.bar(xs, [by_layer[layer]["n_dims"] for layer in layers], width, label=p)
        ax_f.plot(layers, [by_layer[layer]["token_frac"] for layer in layers], marker="o",
                  markersize=3, label=p)
    ax_n.set_yscale("symlog", linthresh=1)              # one dim and five hundred, on one axis
    ax_n.set_ylabel("input dims (log scale past 1)")
    ax_n.set_title(f"input dims where some token has |x| >= {threshold:g}")
    ax_f.set_ylabel("fraction of tokens")
    ax_f.set_title(f"tokens with at least one input |x| >= {threshold:g}")
    for ax in (ax_n, ax_f):
        ax.set_xlabel("layer")
        ax.legend(fontsize=7)
    ax_f.set_ylim(0, 1.02)
    fig.tight_layout()
    return fig
