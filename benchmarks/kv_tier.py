"""The host KV tier (chapter 8, running the server), the record: `minillm.lab.kv_tier.multi_turn`
on the real model, with the tier off and on: prefix hit rates (device, host), prompt tokens
computed, TTFT per turn, and the restore cost per block against the recompute cost (measured,
and the roofline's estimate for this machine); written to kv_tier_<device>.json.

    python -m benchmarks kv_tier [--quick] [--device cuda]

On a GPU the host tier is pinned memory and the restore cost is a host -> device copy, so the same
command measures the restore bandwidth there.
"""
import time

from benchmarks.records import write_result
from minillm.lab.kv_tier import multi_turn

SETTINGS = {  # quick: a smoke run; full: the recorded numbers
    False: dict(users=3, turns=3, max_tokens=8, block_size=16, cost_blocks=32, cost_rounds=7,
                repeats=3),
    True: dict(users=1, turns=2, max_tokens=4, block_size=16, cost_blocks=8, cost_rounds=3),
}
UNITS = {"*_s / ttft_*": "seconds", "*_s_per_block": "seconds per KV block (all layers, K and V)",
         "*_rate": "fraction of the prompt blocks that could be reused", "restore_gb_per_s": "GB/s",
         "bytes_per_block": "bytes"}


def run(quick: bool = False, device=None, out_dir=None, model=None, tokenizer=None) -> dict:
    """Tier off and on on the same workload; writes kv_tier_<device>.json; returns the record."""
    if model is None:
        from minillm.llm import load_model
        model, tokenizer = load_model(device=device)
    t0 = time.perf_counter()
    res = multi_turn(model, tokenizer, **SETTINGS[bool(quick)])
    for run_ in res["runs"].values():        # the token ids are for the exactness check only
        run_["num_outputs"] = len(run_.pop("outputs"))
    res["seconds"] = time.perf_counter() - t0
    res["units"] = UNITS
    path = write_result("kv_tier", res, device=next(model.parameters()).device, out_dir=out_dir)
    print(f"wrote {path}")
    return res


def report(res: dict) -> str:
    lines = []
    for name, r in res["runs"].items():
        lines.append(f"tier {name:3s}: device hits {r['device_hit_rate']:.0%}, host hits "
                     f"{r['host_hit_rate']:.0%} of {r['queried_blocks']} blocks; prompt tokens "
                     f"computed {r['computed_prompt_tokens']}/{r['prompt_tokens']} (the chats' by "
                     f"turn {r['computed_prompt_tokens_by_turn']}); mean TTFT by "
                     f"turn " + ", ".join(f"{t:.3f}" for t in r["ttft_mean_by_turn_s"]) + " s")
    lines.append(f"outputs identical: {res['identical']}; TTFT off/on by turn: "
                 + ", ".join(f"{x:.2f}x" for x in res["ttft_off_over_on_by_turn"]))
    c = res["costs"]
    roof = c["roofline_restore_s_per_block"]
    lines.append(f"per block ({c['bytes_per_block'] / 2**10:.0f} KiB): restore "
                 f"{c['restore_s_per_block'] * 1e6:.0f} us ({c['restore_gb_per_s']:.1f} GB/s"
                 f"{', pinned' if c['pinned'] else ''}; roofline "
                 f"{'-' if roof is None else f'{roof * 1e6:.0f} us'}), recompute "
                 f"{c['recompute_s_per_block'] * 1e3:.1f} ms (roofline "
                 f"{c['roofline_recompute_s_per_block'] * 1e3:.1f} ms): recompute/restore "
                 f"{c['recompute_over_restore']:.0f}x")
    return "\n".join(lines)
