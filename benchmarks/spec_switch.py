"""Speculation that steps aside (chapter 8, issue 37), the record: `minillm.lab.spec_switch.compare`
on the real model at a bigger size than the chapter's, written to spec_switch_<device>.json.

    python -m benchmarks spec_switch [--quick]

Off, always-on n-gram drafting and the per-step switch (`speculative_disable_by_batch_size`, its
threshold measured in the same run: the smallest batch where drafting stopped paying), at low
load (per-token latency) and high load (output tokens/s), greedy, outputs checked identical.
"""
import time

from benchmarks.records import write_result
from minillm.lab.spec_switch import compare

SETTINGS = {  # quick: a smoke run on 2 cores; full: the recorded numbers
    False: dict(batch_sizes=(1, 2, 4, 8, 16, 32), max_tokens=32, rounds=2, min_requests=4),
    True: dict(batch_sizes=(1, 4), max_tokens=8, rounds=1),
}

UNITS = {"*tokens_per_s": "generated tokens per second of wall time (prefill included)",
         "*decode_tokens_per_s": "tokens per second of the decode-only steps (no prompt tokens)",
         "*tpot_s": "seconds per output token after the first, mean over requests",
         "steps_*": "engine steps with decodes", "sweep_speedup": "always-on / off tokens per second",
         "threshold": "speculative_disable_by_batch_size (running requests)", "seconds": "seconds"}


def run(quick: bool = False, device=None, out_dir=None, model=None, tokenizer=None) -> dict:
    """The comparison on the real model; writes spec_switch_<device>.json; returns the record."""
    if model is None:
        from minillm.llm import load_model
        model, tokenizer = load_model(device=device)
    t0 = time.perf_counter()
    res = compare(model, tokenizer, **SETTINGS[bool(quick)])
    m = res["modes"]
    res["ratios"] = {
        "low_tpot_off_over_switch": m["off"]["low_tpot_s"] / m["switch"]["low_tpot_s"],
        "low_tpot_off_over_always": m["off"]["low_tpot_s"] / m["always"]["low_tpot_s"],
        "high_tokens_per_s_switch_over_off": m["switch"]["high_tokens_per_s"] / m["off"]["high_tokens_per_s"],
        "high_tokens_per_s_switch_over_always":
            m["switch"]["high_tokens_per_s"] / m["always"]["high_tokens_per_s"],
        "high_decode_tokens_per_s_switch_over_off":
            m["switch"]["high_decode_tokens_per_s"] / m["off"]["high_decode_tokens_per_s"],
        "high_decode_tokens_per_s_switch_over_always":
            m["switch"]["high_decode_tokens_per_s"] / m["always"]["high_decode_tokens_per_s"]}
    res["seconds"] = time.perf_counter() - t0
    res["units"] = UNITS
    path = write_result("spec_switch", res, device=next(model.parameters()).device, out_dir=out_dir)
    print(f"wrote {path}")
    return res


def report(res: dict) -> str:
    lines = [f"{'B':>4} {'off tok/s':>10} {'always tok/s':>13} {'decode speedup':>15}   (decode-only steps)"]
    for i, B in enumerate(res["batch_sizes"]):
        lines.append(f"{B:>4} {res['sweep_decode_tokens_per_s']['off'][i]:>10.1f} "
                     f"{res['sweep_decode_tokens_per_s']['always'][i]:>13.1f} {res['sweep_speedup'][i]:>14.2f}x")
    lines.append(f"speculative_disable_by_batch_size = {res['threshold']} ({res['threshold_from']})")
    lines.append(f"{'mode':<7} {'low TPOT ms':>12} {'low tok/s':>10} {'high tok/s':>11} "
                 f"{'high decode tok/s':>18} {'high steps spec/skip':>21}")
    for mode, r in res["modes"].items():
        lines.append(f"{mode:<7} {r['low_tpot_s'] * 1e3:>12.1f} {r['low_tokens_per_s']:>10.1f} "
                     f"{r['high_tokens_per_s']:>11.1f} {r['high_decode_tokens_per_s']:>18.1f} "
                     f"{r['high_steps_speculated']:>14}/{r['high_steps_skipped']}")
    lines += [f"{k}: {v:.2f}x" for k, v in res["ratios"].items()]
    lines.append(f"identical outputs in every mode: {res['same_outputs']}; load average {res['load_average']}")
    return "\n".join(lines)
