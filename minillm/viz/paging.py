"""Pictures and small simulations for chapter 3 (the paged KV cache).

Letters: N physical blocks, P block size (token slots per block).

- `snapshot(bm)` copies a `BlockManager`'s state into a plain dict; `plot_block_tables` draws a
  list of snapshots, one panel each: every sequence's block table (logical block -> physical
  block, the filled part of each block shaded) above the physical pool (neutral blocks; a thick
  edge and "xN" mark refcount N > 1, cached blocks are hatched, copy-on-write copies are red
  arrows), with a legend (`legend_handles`).
- `heavy_tailed_workload` + `simulate_memory` run a seeded workload through the real
  `BlockManager` and count KV slots used, allocated (paging) and reserved (a contiguous
  max-length reservation per request); `plot_memory_timeline`, `plot_waste_vs_block_size`.
- `sharing_strategies` counts blocks and recomputed prompt tokens for n completions of one
  prompt: no sharing, fork + copy-on-write, and full-block-only sharing (vLLM's newer design).

Left out on purpose: memory limits and preemption (the simulations measure, they never run
out: the scheduler chapter does that), and the KV tensors themselves (minillm.paging.paged_cache).
"""
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minillm.analysis.kv_math import lognormal_lengths
from minillm.paging.block_manager import BlockManager

# Colour means one thing only: which sequence (its row, its arrows). Physical blocks are neutral:
# white = free, grey = in use; a block with refcount > 1 gets a thick edge and a bold "xN"
# (N = refcount), and a block in the prefix cache is hatched. Every figure carries that legend.
REF_COLORS = {0: "white", 1: "#d9d9d9", 2: "#d9d9d9"}  # refcount 0 / 1 / >= 2 (shared: thick edge)
SHARED_EDGE = 2.4                                      # edge width of a block with refcount > 1


def snapshot(bm: BlockManager) -> dict:
    """A plain copy of what the pictures need (tables, lengths, refcounts, cache flags)."""
    ids = bm.seq_ids()
    return {"block_size": bm.block_size,
            "tables": {s: bm.block_table(s) for s in ids},
            "num_tokens": {s: bm.num_tokens(s) for s in ids},
            "ref_counts": [bm.ref_count(b) for b in range(bm.num_blocks)],
            "cached": [bm.is_cached(b) for b in range(bm.num_blocks)]}


def _draw_pool_block(ax, b: int, rc: int, cached: bool, y: float) -> None:
    shared = rc > 1
    ax.add_patch(Rectangle((b, y), 0.9, 0.9, facecolor=REF_COLORS[min(rc, 2)], edgecolor="black",
                           lw=SHARED_EDGE if shared else 0.8, hatch="//" if cached else None))
    box = dict(facecolor=REF_COLORS[min(rc, 2)], edgecolor="none", pad=0.3)  # readable on hatch
    ax.text(b + 0.45, y + 0.62, f"#{b}", ha="center", va="center", fontsize=8, bbox=box)
    ax.text(b + 0.45, y + 0.25, f"\u00d7{rc}" if shared else f"rc={rc}", ha="center", va="center",
            fontsize=8 if shared else 7, fontweight="bold" if shared else "normal", bbox=box)


def _draw_panel(ax, snap: dict, title: str, copies) -> None:
    P, refs, tables = snap["block_size"], snap["ref_counts"], snap["tables"]
    rows = len(tables)
    pool_y = 0.0
    for b, rc in enumerate(refs):  # the physical pool, bottom row
        _draw_pool_block(ax, b, rc, snap["cached"][b], pool_y)
    ax.text(-0.3, pool_y + 0.45, "physical\nblocks", ha="right", va="center", fontsize=8)
    for r, (s, table) in enumerate(tables.items()):  # one row per sequence, above the pool
        y, n = 2.0 + 1.5 * (rows - 1 - r), snap["num_tokens"][s]
        color = f"C{r % 10}"                          # the sequence's colour, used for nothing else
        ax.text(-0.3, y + 0.45, f"seq {s}\n{n} tok", ha="right", va="center", fontsize=8, color=color)
        for j, b in enumerate(table):
            filled = min(P, n - j * P) / P
            ax.add_patch(Rectangle((j, y), 0.9 * filled, 0.9, facecolor=color, alpha=0.25))
            ax.add_patch(Rectangle((j, y), 0.9, 0.9, fill=False, edgecolor=color,
                                   lw=SHARED_EDGE if refs[b] > 1 else 0.8))
            ax.text(j + 0.45, y + 0.45, f"L{j}\u2192{b}", ha="center", va="center", fontsize=7)
            ax.add_patch(FancyArrowPatch((j + 0.45, y), (b + 0.45, pool_y + 0.9), arrowstyle="-|>",
                                         mutation_scale=8, color=color, alpha=0.6, lw=0.8))
    for src, dst in copies or []:
        ax.add_patch(FancyArrowPatch((src + 0.45, pool_y), (dst + 0.45, pool_y), color="red",
                                     arrowstyle="-|>", connectionstyle="arc3,rad=0.4",
                                     mutation_scale=10, lw=1.5))
        ax.text((src + dst) / 2 + 0.45, pool_y - 0.75, f"copy {src}\u2192{dst}", color="red",
                ha="center", fontsize=8)
    width = max([len(refs)] + [len(t) for t in tables.values()])
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(-1.1, 2.0 + 1.5 * max(rows, 1) - 0.4)
    ax.set_title(title, fontsize=9, loc="left")
    ax.axis("off")


def legend_handles(with_copies: bool = True) -> list:
    """The legend every block-table figure carries: what fill, edge, hatch and red mean."""
    handles = [Patch(facecolor=REF_COLORS[0], edgecolor="black", lw=0.8, label="free (refcount 0)"),
               Patch(facecolor=REF_COLORS[1], edgecolor="black", lw=0.8, label="in use by one sequence"),
               Patch(facecolor=REF_COLORS[2], edgecolor="black", lw=SHARED_EDGE,
                     label="shared: refcount \u00d7N > 1 (thick edge)"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="in the prefix cache"),
               Patch(facecolor="C0", alpha=0.25, edgecolor="C0",
                     label="a sequence's logical block (colour = sequence; shade = filled part)")]
    if with_copies:
        handles.append(Line2D([], [], color="red", lw=1.5, label="copy-on-write copy src\u2192dst"))
    return handles


def plot_block_tables(snapshots: list[dict], titles: list[str] | None = None,
                      copies: list | None = None):
    """One panel per snapshot, top to bottom. `copies[i]`: CoW (src, dst) pairs of step i.
    Physical blocks: white = free, grey = in use, thick edge and "xN" = shared by N > 1
    sequences, hatched = in the prefix cache; colour only tells the sequences apart (legend below)."""
    if not snapshots:
        raise ValueError("snapshots must hold at least one snapshot")
    titles = titles or [f"step {i}" for i in range(len(snapshots))]
    copies = copies or [[] for _ in snapshots]
    if not len(titles) == len(copies) == len(snapshots):
        raise ValueError("titles and copies must have one entry per snapshot")
    heights = [1.6 + 0.75 * max(len(s["tables"]), 1) for s in snapshots]
    width = max(max(len(s["ref_counts"]), *(len(t) for t in s["tables"].values()), 1)
                for s in snapshots)
    legend_h = 0.85
    fig, axes = plt.subplots(len(snapshots), 1, figsize=(max(1.5 + 0.62 * width, 7.0),
                                                          sum(heights) + legend_h),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, snap, title, cp in zip(axes[:, 0], snapshots, titles, copies):
        _draw_panel(ax, snap, title, cp)
    fig.legend(handles=legend_handles(any(copies)), loc="lower center", ncol=2, fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, legend_h / (sum(heights) + legend_h), 1, 1))
    return fig


# ---- memory used vs reserved ---------------------------------------------------------------------
def heavy_tailed_workload(num_requests: int = 300, max_len: int = 2048, seed: int = 0,
                          prompt_median: float = 96.0, output_median: float = 160.0,
                          sigma: float = 1.0) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs, log-normal (a long right tail: chapter 2's
    `lognormal_lengths`), clipped so that prompt + output <= max_len. Medians are in tokens;
    sigma is the log-space spread."""
    if num_requests < 1 or max_len < 2:
        raise ValueError(f"need num_requests >= 1 and max_len >= 2, got {num_requests}, {max_len}")
    g = torch.Generator().manual_seed(seed)            # one seed, two streams: prompts, outputs
    prompt = lognormal_lengths(num_requests, prompt_median, sigma, high=max_len - 1, generator=g)
    output = lognormal_lengths(num_requests, output_median, sigma, generator=g)
    return [(p, min(o, max_len - p)) for p, o in zip(prompt, output)]


def simulate_memory(workload: list[tuple[int, int]], max_len: int, block_size: int,
                    max_num_seqs: int = 16) -> dict:
    """Serve the workload `max_num_seqs` at a time (a new request joins when one finishes; the
    prompt in one step, then one token per step) through a BlockManager. Per step it records KV
    slots used (tokens stored), allocated (used blocks x P) and reserved (running x max_len)."""
    per_seq = -(-max_len // block_size)
    bm = BlockManager(max_num_seqs * per_seq, block_size)
    queue, running, rid = list(workload), {}, 0
    used, allocated, reserved = [], [], []
    while queue or running:
        while queue and len(running) < max_num_seqs:
            prompt_len, output_len = queue.pop(0)
            bm.allocate(rid, [0] * prompt_len)
            running[rid] = prompt_len + output_len
            rid += 1
        used.append(sum(bm.num_tokens(s) for s in running))
        allocated.append(bm.num_used_blocks * block_size)
        reserved.append(len(running) * max_len)
        for s in list(running):  # one decode step: every sequence grows by one token
            if bm.num_tokens(s) >= running[s]:
                bm.free(s)
                del running[s]
            else:
                bm.append_tokens(s, [0])
    u, a, r = (np.array(x, dtype=float) for x in (used, allocated, reserved))
    return {"block_size": block_size, "max_len": max_len, "used": u, "allocated": a, "reserved": r,
            "reservation_utilization": u.sum() / r.sum(), "paging_utilization": u.sum() / a.sum(),
            "paging_waste": 1 - u.sum() / a.sum()}


def plot_memory_timeline(sim: dict):
    """KV slots over the run: used vs paged (allocated) vs contiguous reservation."""
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    steps = np.arange(len(sim["used"]))
    ax.plot(steps, sim["reserved"], color="C3", label=f"reserved, max_len={sim['max_len']} "
            f"(util. {sim['reservation_utilization']:.0%})")
    ax.plot(steps, sim["allocated"], color="C0", label=f"paged, P={sim['block_size']} "
            f"(util. {sim['paging_utilization']:.1%})")
    ax.fill_between(steps, sim["used"], color="C2", alpha=0.4, label="used (tokens with KV)")
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV slots (tokens)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, sim["reserved"].max() * 1.35)
    fig.tight_layout()
    return fig


def plot_waste_vs_block_size(sims: list[dict], claim=(0.03, 0.06)):
    """Paging waste (allocated but empty slots) per block size, with the claimed band."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ps = [s["block_size"] for s in sims]
    waste = [100 * s["paging_waste"] for s in sims]
    ax.axhspan(100 * claim[0], 100 * claim[1], color="C1", alpha=0.2, label="claimed 3-6%")
    ax.plot(ps, waste, "o-", label="measured paging waste")
    for p, w in zip(ps, waste):
        ax.annotate(f"{w:.1f}%", (p, w), textcoords="offset points", xytext=(0, 6), fontsize=8,
                    ha="center")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_xlabel("block size P (tokens)")
    ax.set_ylabel("waste (% of allocated slots)")
    ax.set_title(f"reservation at max_len={sims[0]['max_len']} uses "
                 f"{sims[0]['reservation_utilization']:.0%} of what it reserves", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- n completions of one prompt: three ways to share ---------------------------------------------
def sharing_strategies(prompt_len: int, n: int, gen_len: int, block_size: int) -> dict:
    """Blocks held after each of n completions generated gen_len tokens, CoW copies and prompt
    tokens computed, for: 'no sharing' (n separate prompts), 'fork + CoW' (ours), and
    'full blocks only' (n requests meet in the prefix cache; a partial last block is recomputed)."""
    prompt, need = list(range(prompt_len)), n * -(-(prompt_len + gen_len) // block_size)
    out = {}
    for name in ("no sharing", "fork + CoW", "full blocks only"):
        bm = BlockManager(need + n, block_size, enable_prefix_caching=name == "full blocks only")
        bm.allocate(0, prompt)
        bm.mark_computed(0, prompt_len)
        computed = prompt_len
        for i in range(1, n):
            if name == "fork + CoW":
                bm.fork(0, i)
            else:
                computed += prompt_len - bm.allocate(i, prompt)
                bm.mark_computed(i, prompt_len)
        copies = [bm.append_tokens(i, [10**6 + 1000 * i + t]) for t in range(gen_len) for i in range(n)]
        out[name] = {"blocks": bm.num_used_blocks, "cow_copies": sum(map(len, copies)),
                     "prompt_tokens_computed": computed}
    return out
