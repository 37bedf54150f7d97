"""A speculative-decoding benchmark record as text (chapter 6 and its appendix print the
committed one; `python -m benchmarks spec` prints the one it just wrote).

The record's shape is the benchmark's (`benchmarks/spec.py`): "ngram" per prompt, "ngram_summary",
"self_drafts" with a "summary" each, and "small_batch".
Left out on purpose: anything that measures or writes; this only reads a record.
"""


def report(r: dict) -> str:
    """The record as text. `alpha` is the per-token estimate (`SpecStats.alpha_estimate`, the
    JSON's "acceptance" of batch-1 entries); "predicted from alpha" = the i.i.d. formula, "from the
    steps run" = the same costs applied to the steps the run actually took."""
    lines = ["n-gram (prompt lookup), K = %d:" % r["settings"]["k_ngram"]]
    for name, e in r["ngram"].items():
        lines.append(f"  {name:>10}: alpha={e['acceptance']:.2f} tokens/step={e['tokens_per_step']:.2f} "
                     f"speedup {e['speedup']:.2f}x (predicted {e['predicted']:.2f}x from alpha, "
                     f"{e['predicted_from_steps']:.2f}x from the steps run) | transformers "
                     f"prompt lookup {e['hf_speedup']:.2f}x | identical={e['same_as_plain']}")
    sm = r["ngram_summary"]
    lines.append(f"  all prompts: minillm {sm['speedup']:.2f}x, transformers {sm['hf_speedup']:.2f}x; "
                 f"ceiling of these schedules with v = 1 and free drafts {sm['ceiling_v1']:.2f}x")
    lines.append("self-drafts, K = %d:" % r["settings"]["k_draft"])
    for name, d in r["self_drafts"].items():
        if "summary" in d:
            m = d["summary"]
            lines.append(f"  {name:>10} ({d['description']}): alpha={m['acceptance']:.2f} c={m['c']:.2f} "
                         f"v={m['verify_cost']:.2f} draft prefill={m['draft_prefill_cost']:.1f} steps | "
                         f"measured {m['speedup']:.2f}x predicted {m['predicted']:.2f}x "
                         f"(decode only {m['predicted_decode']:.2f}x, ideal v=1 {m['predicted_ideal']:.2f}x)"
                         f" | transformers assisted {m['hf_speedup']:.2f}x")
    if "small_batch" in r:
        b = r["small_batch"]
        lines.append(f"batch of {b['batch']} in the engine, n-gram K = {r['settings']['k_ngram']}: "
                     f"{b['plain']['tokens_per_s']:.1f} -> {b['ngram']['tokens_per_s']:.1f} tokens/s = "
                     f"{b['speedup']:.2f}x (accepted/drafted {b['ngram']['acceptance']:.2f}, "
                     f"identical={b['same_as_plain']})")
    return "\n".join(lines + ([f"wrote {r['path']}"] if r.get("path") else []))
