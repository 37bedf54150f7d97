"""The SLO controller under a load step, drawn (chapter 8; the dict of
`minillm.lab.slo_step.compare`, or the record of `python -m benchmarks slo_control`).

`slo_step_plot(res)`: three panels over the seconds of the run, the load step shaded: requests
sent and each run's token budget, then the rolling P95 TPOT and P95 TTFT of each run with the
target as a dashed line. Returns a Figure (save it with `minillm.viz.plotting.save_figure`).
"""
import matplotlib.pyplot as plt

COLORS = ("#08519c", "#cb181d", "#238b45", "#6a51a3", "#636363")


def slo_step_plot(res: dict):
    runs = res["runs"]
    first = next(iter(runs.values()))
    cfg = first["config"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    ts = [r["t"] for r in first["timeline"]]
    axes[0].bar(ts, [r["sent"] for r in first["timeline"]], width=0.9, color="#d9d9d9",
                label="requests sent (per s)")
    axes[0].set_ylabel("requests sent / s")
    bx = axes[0].twinx()
    for (name, run), color in zip(runs.items(), COLORS):
        tl = run["timeline"]
        bx.step([r["t"] for r in tl], [r["budget"] for r in tl], where="post", color=color, label=name)
        for ax, key in ((axes[1], "p95_tpot"), (axes[2], "p95_ttft")):
            pts = [(r["t"], r[key]) for r in tl if r[key] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=name)
    bx.set_ylabel("max_num_batched_tokens")
    bx.set_yscale("log", base=2)
    bx.legend(loc="upper right", fontsize=8)
    for ax, key, what in ((axes[1], "tpot", "P95 TPOT (s)"), (axes[2], "ttft", "P95 TTFT (s)")):
        ax.axhline(res["targets_ms"][key] / 1e3, color="black", ls="--", lw=1, label="target")
        ax.set_ylabel(f"rolling {what}")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.axvspan(cfg["base_s"], cfg["base_s"] + cfg["step_s"], color="#fdd0a2", alpha=0.3, lw=0)
    axes[2].set_xlabel(f"seconds (rate {res['rate']:.2f}/s, doubled in the shaded step; "
                       f"P95 over the trailing {cfg['window_s']:g} s)")
    fig.tight_layout()
    return fig
