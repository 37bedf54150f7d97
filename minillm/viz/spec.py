"""Figures for chapter 6: one verify step drawn as distributions, speedup theory, fact check,
K policies, and the benchmark's measured vs predicted speedups. Every function returns a Figure.

Letters: K draft tokens per step, V vocab, a acceptance rate, c draft/target cost ratio.
"""
import matplotlib.pyplot as plt
import torch

import minillm.analysis.spec_theory as th


def plot_step_distributions(p: torch.Tensor, q: torch.Tensor, labels=None):
    """One position: p, q, the accepted mass min(p, q) and the residual norm(max(p - q, 0))."""
    V = len(p)
    labels = labels or [str(i) for i in range(V)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 2.8), sharey=True)
    x = torch.arange(V)
    axes[0].bar(x - 0.2, p, 0.4, label="target p")
    axes[0].bar(x + 0.2, q, 0.4, label="draft q")
    axes[0].set_title("the two laws")
    overlap = torch.minimum(p, q)
    axes[1].bar(x, overlap, color="tab:green", label="min(p, q): kept draft")
    axes[1].bar(x, (p - q).clamp(min=0), bottom=overlap, color="tab:red", label="max(p - q, 0)")
    axes[1].set_title(f"accept prob = sum min(p, q) = {float(overlap.sum()):.3f}")
    resid = (p - q).clamp(min=0)
    axes[2].bar(x, resid / resid.sum(), color="tab:red")
    axes[2].set_title("residual law after a rejection")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.legend(fontsize=7) if ax is not axes[2] else None
    fig.tight_layout()
    return fig


def plot_speedup_vs_k(a_values=(0.5, 0.7, 0.8, 0.9, 0.95), c: float = 0.1, k_max: int = 12,
                      verify_cost: float = 1.0, ax=None):
    """Expected speedup against K for several acceptance rates; dots mark the best K."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 3.6))
    ks = list(range(k_max + 1))
    for a in a_values:
        ys = [th.expected_speedup(a, k, c, verify_cost) for k in ks]
        line, = ax.plot(ks, ys, label=f"a = {a:.2f}")
        kb = th.best_k(a, c, k_max, verify_cost)
        ax.plot([kb], [ys[kb]], "o", color=line.get_color())
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="K (draft tokens per verify step)", ylabel="expected speedup",
           title=f"c = {c:.2f}, verify cost = {verify_cost:.2f}")
    ax.legend(fontsize=8)
    return fig


def plot_fact_check(a: float = 0.8, speed_ratio: float = 10.0, k_max: int = 10, sims=None):
    """Seed article 000's printed factor s / (1 + s K) vs the corrected s / (s + K) vs simulation."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ks = list(range(1, k_max + 1))
    ax.plot(ks, [th.speedup_from_speed_ratio(a, k, speed_ratio) for k in ks], label="s / (s + K)")
    ax.plot(ks, [th.article_speedup_printed(a, k, speed_ratio) for k in ks], "--",
            label="printed: s / (1 + s K)")
    if sims is not None:
        ax.plot(ks, sims, "k.", ms=9, label="simulation")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set(xlabel="K", ylabel="speedup", title=f"a = {a}, draft {speed_ratio:g}x faster (c = {1 / speed_ratio:.2f})")
    ax.legend(fontsize=8)
    return fig


def plot_policies(acceptance: list[float], history: dict[str, list[int]], speedups: dict[str, float]):
    """K chosen over time by each policy, over the per-step acceptance rate."""
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for name, ks in history.items():
        ax.step(range(len(ks)), ks, where="post", label=f"{name}: {speedups[name]:.2f}x")
    ax2 = ax.twinx()
    ax2.plot(acceptance, color="black", lw=1.5, ls=":", label="true alpha (right axis)")
    ax2.set(ylabel="true alpha", ylim=(0, 1.05))
    ax.set(xlabel="verify step", ylabel="K", title="choosing K while decoding")
    lines = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.08, 1.0))                 # beside the plot
    fig.tight_layout()
    return fig


def plot_spec_benchmark(result: dict):
    """Measured vs predicted speedup (n-gram per prompt; each self-draft), with transformers.

    Two predictions, labelled by what they are computed from: "from alpha" is the i.i.d. formula
    E[tokens](alpha, K) / (K c + v) with the measured costs (plus prefills); "from the steps run"
    (n-gram only) puts the same costs on the steps the run actually took, so only the costs are
    predicted there, not the acceptance."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [4, 3]})
    groups = [("n-gram, K = %d" % result["settings"]["k_ngram"], result["ngram"], True)]
    sd = {n: d["summary"] for n, d in result["self_drafts"].items() if "summary" in d}
    groups.append(("self-drafts, K = %d" % result["settings"]["k_draft"], sd, False))
    for ax, (title, entries, with_steps) in zip(axes, groups):
        names = list(entries)
        x = torch.arange(len(names)).float()
        bars = [("speedup", "measured (minillm)"), ("predicted", "predicted from alpha, c, v")]
        if with_steps:
            bars.append(("predicted_from_steps", "predicted from the steps run, c, v"))
        bars.append(("hf_speedup", "transformers, measured"))
        w = 0.8 / len(bars)
        for j, (key, label) in enumerate(bars):
            ax.bar(x + (j - (len(bars) - 1) / 2) * w, [entries[n][key] for n in names], w, label=label)
        for i, n in enumerate(names):
            ax.text(float(x[i]) - (len(bars) - 1) / 2 * w, entries[n]["speedup"],
                    f"alpha={entries[n]['acceptance']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(list(x), names)
        ax.set(title=title, ylabel="speedup over plain decode (batch 1)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_accepted_histogram(observed: dict[str, list[int]], laws: dict[str, list[float]], k: int):
    """Per prompt: the fraction of verify steps that accepted n = 0..K drafts (bars) against the
    truncated geometric law of the i.i.d. theory at the same alpha (dots)."""
    fig, axes = plt.subplots(1, len(observed), figsize=(2.8 * len(observed), 2.8), sharey=True)
    axes = [axes] if len(observed) == 1 else list(axes)
    for ax, (name, counts) in zip(axes, observed.items()):
        steps = max(1, len(counts))
        freq = [sum(c == n for c in counts) / steps for n in range(k + 1)]
        ax.bar(range(k + 1), freq, color="C0", label="observed steps")
        ax.plot(range(k + 1), laws[name], "o", color="C3", label="i.i.d. law at alpha")
        ax.set(title=name, xlabel="drafts accepted in a step")
    axes[0].set_ylabel("fraction of steps")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def explorer_view(a: float, k: int, c: float, verify_cost: float = 1.0):
    """(Figure, text) for the explorer: speedup against K at this a, and against a at this K."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    plot_speedup_vs_k((a,), c, max(12, k), verify_cost, ax=left)
    left.axvline(k, color="k", lw=0.8, ls=":")
    grid = [i / 100 for i in range(101)]
    right.plot(grid, [th.expected_speedup(x, k, c, verify_cost) for x in grid])
    right.axhline(1.0, color="gray", lw=0.8, ls="--")
    right.axvline(a, color="k", lw=0.8, ls=":")
    right.set(xlabel="acceptance rate a", ylabel="expected speedup", title=f"K = {k}, c = {c:.2f}")
    fig.tight_layout()
    text = (f"a={a:.2f} K={k} c={c:.2f}: E[tokens/step]={th.expected_tokens_per_step(a, k):.3f}, "
            f"speedup={th.expected_speedup(a, k, c, verify_cost):.3f}x, "
            f"best K={th.best_k(a, c, 16, verify_cost)}")
    return fig, text


def spec_explorer(a: float = 0.8, k: int = 4, c: float = 0.1):
    """ipywidgets sliders for a, K, c redrawing `explorer_view`, then its static twin below
    (so a notebook rendered without a widget frontend still shows a figure and the numbers)."""
    import ipywidgets as w
    from IPython.display import display
    controls = {"a": w.FloatSlider(value=a, min=0.0, max=1.0, step=0.01, description="a"),
                "k": w.IntSlider(value=k, min=1, max=16, description="K"),
                "c": w.FloatSlider(value=c, min=0.0, max=1.0, step=0.01, description="c")}
    out = w.Output()

    def redraw(a, k, c):
        with out:
            out.clear_output(wait=True)
            fig, text = explorer_view(a, k, c)
            display(fig)
            print(text)
            plt.close(fig)
    ui = w.interactive_output(redraw, controls)
    display(w.VBox([w.HBox(list(controls.values())), out, ui]))
    fig, text = explorer_view(a, k, c)
    display(fig)
    print(text)
    plt.close(fig)
    return fig
