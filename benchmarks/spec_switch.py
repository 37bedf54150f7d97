"""Speculation that steps aside (chapter 8), the record: `minillm.lab.spec_switch.compare`
on the real model at a bigger size than the chapter's, written to spec_switch_<device>.json.

    python -m benchmarks spec_switch [--quick]

Off, always-on n-gram drafting and the per-step switch (`speculative_disable_by_batch_size`, its
threshold measured in the same run: the smallest batch from which drafting stopped paying), at
low load (per-token latency) and high load (output tokens/s), greedy, outputs checked identical;
on two workloads: chapter 6's grounded prompts (drafts mostly right) and open questions with
drafts from 1-token matches (mostly wrong), where the threshold differs.
"""
import time

from benchmarks.records import write_result
from minillm.lab.prompts import DECODE_PROMPTS
from minillm.lab.spec_switch import compare

SETTINGS = {  # quick: a smoke run on 2 cores; full: the recorded numbers
    False: dict(batch_sizes=(1, 2, 4, 8, 16, 32), max_tokens=32, rounds=2, min_requests=4),
    True: dict(batch_sizes=(1, 4), max_tokens=8, rounds=1),
}
# the second workload, "open": open questions, where a lookup drafter rarely has the answer in its
# context, drafting from 1-token matches (mostly wrong): what always-on costs when drafts are poor
OPEN = {False: dict(batch_sizes=(1, 4, 16, 32), max_tokens=32, rounds=2, min_requests=4, min_ngram=1),
        True: dict(batch_sizes=(1, 4), max_tokens=8, rounds=1, min_ngram=1)}

UNITS = {"*tokens_per_s": "generated tokens per second of wall time (prefill included)",
         "*decode_tokens_per_s": "tokens per second of the decode-only steps (no prompt tokens)",
         "*tpot_s": "seconds per output token after the first, mean over requests",
         "steps_*": "engine steps with decodes", "sweep_speedup": "always-on / off tokens per second",
         "threshold": "speculative_disable_by_batch_size (running requests)", "seconds": "seconds"}


def ratios(res: dict) -> dict:
    """Switch against off and always-on: low-load TPOT, high-load tokens/s (end to end, decode)."""
    m, out = res["modes"], {}
    for other in ("off", "always"):
        out[f"low_tpot_{other}_over_switch"] = m[other]["low_tpot_s"] / m["switch"]["low_tpot_s"]
        for key in ("tokens_per_s", "decode_tokens_per_s"):
            out[f"high_{key}_switch_over_{other}"] = m["switch"][f"high_{key}"] / m[other][f"high_{key}"]
    return out


def run(quick: bool = False, device=None, out_dir=None, model=None, tokenizer=None) -> dict:
    """The comparison on the real model; writes spec_switch_<device>.json; returns the record."""
    if model is None:
        from minillm.llm import load_model
        model, tokenizer = load_model(device=device)
    t0 = time.perf_counter()
    res = compare(model, tokenizer, **SETTINGS[bool(quick)])
    res["ratios"] = ratios(res)
    res["open"] = compare(model, tokenizer, prompts={f"q{i}": t for i, t in enumerate(DECODE_PROMPTS)}, **OPEN[bool(quick)])
    res["open"]["ratios"] = ratios(res["open"])
    res["seconds"] = time.perf_counter() - t0
    res["units"] = UNITS
    path = write_result("spec_switch", res, device=next(model.parameters()).device, out_dir=out_dir)
    print(f"wrote {path}")
    return res


def section(res: dict, title: str) -> list[str]:
    lines = [title, f"{'B':>4} {'off tok/s':>10} {'always tok/s':>13} {'speedup':>8}   (decode-only steps)"]
    for i, B in enumerate(res["batch_sizes"]):
        lines.append(f"{B:>4} {res['sweep_decode_tokens_per_s']['off'][i]:>10.1f} "
                     f"{res['sweep_decode_tokens_per_s']['always'][i]:>13.1f} {res['sweep_speedup'][i]:>7.2f}x")
    lines.append(f"speculative_disable_by_batch_size = {res['threshold']} ({res['threshold_from']})")
    lines.append(f"{'mode':<7} {'low TPOT ms':>12} {'low tok/s':>10} {'high tok/s':>11} "
                 f"{'high decode tok/s':>18} {'high steps spec/skip':>21}")
    for mode, r in res["modes"].items():
        lines.append(f"{mode:<7} {r['low_tpot_s'] * 1e3:>12.1f} {r['low_tokens_per_s']:>10.1f} "
                     f"{r['high_tokens_per_s']:>11.1f} {r['high_decode_tokens_per_s']:>18.1f} "
                     f"{r['high_steps_speculated']:>14}/{r['high_steps_skipped']}")
    lines += [f"{k}: {v:.2f}x" for k, v in res["ratios"].items()]
    lines.append(f"identical outputs in every mode: {res['same_outputs']}; load average {res['load_average']}")
    return lines


def report(res: dict) -> str:
    lines = section(res, "grounded prompts (chapter 6), n-gram K=%d" % res["settings"]["k"])
    if "open" in res:
        lines += section(res["open"], "open questions, n-gram from 1-token matches")
    return "\n".join(lines)
