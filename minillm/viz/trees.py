"""Figures for chapter 10: a token tree's attention mask, the tree each machine should verify, and
a drafter's held-out accuracy as it trained. Every function returns a Figure.

Letters: N tree nodes (root included), m draft nodes (N - 1).
"""
import matplotlib.pyplot as plt


def plot_tree_mask(tree, labels=None):
    """The (N, N) mask one verify pass uses: row i sees column j when j is i's ancestor or i."""
    mask = tree.ancestor_mask()                                      # (N, N) bool
    N = mask.shape[0]
    labels = labels or ["root"] + ["".join(map(str, p)) for p in tree.paths]
    fig, ax = plt.subplots(figsize=(3.2 + 0.25 * N, 2.8 + 0.25 * N))
    ax.imshow(mask.float(), cmap="Blues", vmin=0, vmax=1.4)
    ax.set_xticks(range(N), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(N), [f"{lab} (depth {d})" for lab, d in zip(labels, tree.depths)], fontsize=7)
    ax.set_xlabel("key: node (path of top-k ranks)")
    ax.set_title("tree attention mask (the prefix is seen by every row)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_tree_sizing(curves: dict, chosen: dict):
    """curves: {machine: [(m draft nodes, tau, predicted speedup), ...]}; chosen: {machine: m}.
    Left, tau against the tree size (the same for every machine); right, the speedup each
    machine's verify costs turn it into, with the chosen size marked."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (machine, pts) in enumerate(curves.items()):
        m = [p[0] for p in pts]
        if i == 0:
            a.plot(m, [p[1] for p in pts], color="k")
        line, = b.plot(m, [p[2] for p in pts], label=machine)
        best = next(p for p in pts if p[0] == chosen[machine])
        b.plot([best[0]], [best[2]], "o", color=line.get_color())
    a.set_xlabel("draft nodes in the best tree of that size")
    a.set_ylabel("expected tokens per step (tau)")
    b.set_xlabel("draft nodes")
    b.set_ylabel("predicted speedup over plain decoding")
    b.axhline(1.0, color="grey", lw=0.8, ls=":")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_held_out_curve(curve: list[dict]):
    """curve: [{"step", "top1": [depth 1, depth 2, ...], "top5": [...]}] (`train_eagle`'s
    `meta["curve"]`) -> held-out top-1 (solid) and top-5 (dashed) per depth against the step."""
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    steps = [c["step"] for c in curve]
    for d in range(len(curve[0]["top1"])):
        line, = ax.plot(steps, [c["top1"][d] for c in curve], label=f"top-1, depth {d + 1}")
        ax.plot(steps, [c["top5"][d] for c in curve], ls="--", color=line.get_color(),
                label=f"top-5, depth {d + 1}")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
