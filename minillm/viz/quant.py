"""Figures for chapter 7's calibration part: the outlier census per layer. Returns Figures.

Letters: L layers.
"""
import matplotlib.pyplot as plt

from minillm.quant.targets import PROJECTIONS


def plot_outliers(rows: list[dict], threshold: float = 6.0):
    """`outlier_features` rows -> two panels over the L layers: how many input dims of each
    projection reach the threshold, and the fraction of tokens they touch."""
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
    ax_n.set_title(f"input dims with |x| >= {threshold:g}")
    ax_f.set_title("fraction of tokens with such a value")
    for ax in (ax_n, ax_f):
        ax.set_xlabel("layer")
        ax.legend(fontsize=7)
    ax_f.set_ylim(0, 1.02)
    fig.tight_layout()
    return fig
