"""Figure for chapter 8: the token mask of a constrained answer, step by step.

One row per generated token. The cells are the model's own top-k choices before the mask (its
unconstrained ranking, with their probabilities), green where the grammar allowed the token and
red where the mask set its logit to -inf; the last column is the token actually taken and its
rank in the unconstrained ranking. A learner sees where the model wanted to write prose or a code
fence and the grammar forced `{`, and where the two agreed. Letters: T steps, V vocab, k cells.

Left out on purpose: the full vocabulary (a row of V cells is unreadable; the count of allowed
tokens is printed at the right instead) and probabilities after the mask.
"""
import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

ALLOWED, MASKED = "#b7e4b0", "#f4b6b6"


def token_label(tokenizer, token_id: int, width: int = 10) -> str:
    """A token as it reads in a cell: newlines and tabs made visible, spaces as a middle dot."""
    text = tokenizer.decode([int(token_id)])
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u00b7")
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def plot_token_mask(trace, tokens, tokenizer, top_k: int = 5, max_steps: int = 24, title=None):
    """trace: T pairs (raw logits (V,), allowed (V,) bool), as `generate_structured(...,
    trace=[])` fills it; tokens: the T ids taken. Returns the Figure."""
    if len(trace) != len(tokens) or not trace:
        raise ValueError(f"trace and tokens must have the same non-zero length, got "
                         f"{len(trace)} and {len(tokens)}")
    T = min(len(trace), max_steps)
    fig, ax = plt.subplots(figsize=(1.25 * (top_k + 2) + 1.2, 0.36 * T + 1.1))
    for t in range(T):
        logits, allowed = trace[t]
        probs = torch.softmax(logits.float(), -1)                  # (V,): the model, unmasked
        top = torch.topk(probs, top_k).indices.tolist()
        taken = int(tokens[t])
        rank = int((probs > probs[taken]).sum()) + 1
        cells = [(tid, f"{token_label(tokenizer, tid)}\n{float(probs[tid]):.2f}") for tid in top]
        cells.append((taken, f"{token_label(tokenizer, taken)}\nrank {rank}"))
        for c, (tid, label) in enumerate(cells):
            x = c + (0.3 if c == top_k else 0)                     # a gap before "taken"
            ax.add_patch(Rectangle((x, -t - 1), 0.94, 0.9, lw=2.0 if tid == taken else 0.4,
                                   ec="black" if tid == taken else "gray",
                                   fc=ALLOWED if bool(allowed[tid]) else MASKED))
            ax.text(x + 0.47, -t - 0.55, label, ha="center", va="center", fontsize=7,
                    family="monospace")
        ax.text(top_k + 1.4, -t - 0.55, f"{int(allowed.sum())} allowed", va="center", fontsize=7)
    ax.set_xlim(-0.1, top_k + 2.6)
    ax.set_ylim(-T - 0.1, 0.9)
    ax.set_yticks([-t - 0.55 for t in range(T)], [str(t) for t in range(T)], fontsize=7)
    ax.set_xticks([c + 0.47 for c in range(top_k)] + [top_k + 0.77],
                  [f"model's #{c + 1}" for c in range(top_k)] + ["taken"], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_ylabel("generated position")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.legend(handles=[Patch(fc=ALLOWED, ec="gray", label="allowed by the grammar"),
                       Patch(fc=MASKED, ec="gray", label="masked (logit = -inf)")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title or "the token mask at each step (cells: the model's top choices, unmasked)",
                 fontsize=9, pad=22)
    fig.tight_layout()
    return fig
