"""The results ledger: headline numbers from benchmarks/results/*.json, for docs/results.md.

`python -m benchmarks.results_table` rewrites the results table of docs/results.md (the lines
between `<!-- results:start -->` and `<!-- results:end -->`) from the committed JSON records, so no
number in the docs is typed by hand; `python -m benchmarks.results_table --check` only says whether
the table is up to date (exit status 1 when it is not). `ledger_for(benchmark, metric_path)` gives the
committed values of every device (the CPU run, the H200 run) with labels saying where each came
from.

A metric path walks a record: "batch1.minillm_tok_per_s" is record["batch1"]["minillm_tok_per_s"],
"decode.measured_s.0" is record["decode"]["measured_s"][0].

Left out on purpose: history (one record per benchmark and device: the latest run overwrites the
file), statistics across runs, and any other output format than one markdown table.
"""
import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.records import REPO_ROOT, results_dir as default_results_dir

START, END = "<!-- results:start -->", "<!-- results:end -->"
RESULTS_PAGE = REPO_ROOT / "docs" / "results.md"


@dataclass(frozen=True)
class Headline:
    benchmark: str
    metric_path: str
    label: str
    unit: str
    scale: float = 1.0        # value shown = stored value * scale (bytes/s -> GB/s, s -> ms)


HEADLINES = [
    Headline("decode", "batch1.minillm_tok_per_s", "decode, batch 1", "tok/s"),
    Headline("decode", "batch8.minillm_tok_per_s", "decode, batch 8", "tok/s"),
    Headline("decode", "batch1.speedup_vs_transformers", "batch-1 decode vs transformers", "x"),
    Headline("decode", "batch1_fraction_of_floor", "batch-1 decode / bandwidth floor", "%", 100),
    Headline("decode", "batch1_matmuls_fraction_of_floor",
             "batch-1 decode's matmuls alone / bandwidth floor (the most its kernels allow)", "%", 100),
    Headline("decode", "batch8.minillm_engine_ms_per_step", "decode, batch 8 through the engine", "ms"),
    Headline("decode", "batch8.speedup_vs_transformers", "batch-8 decode (engine) vs transformers", "x"),
    Headline("decode", "verify_cost.rows.3.ratio", "forward of 9 tokens / forward of 1 (verify cost)", "x"),
    Headline("decode", "verify_cost.rows.3.least",
             "forward of 9 tokens / of 1: the least the matmul kernels allow", "x"),
    Headline("kernels", "decode_ms_per_token.auto", "batch-1 decode, minillm's default CPU routes", "ms"),
    Headline("kernels", "decode_ms_per_token.floor", "batch-1 decode floor (weights / read bandwidth)", "ms"),
    Headline("overhead", "batch1.engine_ms", "engine step, 30-layer d_model-64 model, batch 1", "ms"),
    Headline("overhead", "batch32.engine_ms", "engine step, 30-layer d_model-64 model, batch 32", "ms"),
    Headline("overhead", "baseline.baseline_over_current.batch1",
             "engine step of the baseline commit / this one, batch 1", "x"),
    Headline("overhead", "baseline.baseline_over_current.batch8",
             "engine step of the baseline commit / this one, batch 8", "x"),
    Headline("overhead", "baseline.baseline_over_current.batch32",
             "engine step of the baseline commit / this one, batch 32", "x"),
    Headline("roofline", "hardware.mem_bandwidth", "memory bandwidth (measured)", "GB/s", 1e-9),
    Headline("roofline", "hardware.peak_flops.fp32", "fp32 matmul peak (measured)", "TFLOP/s", 1e-12),
    Headline("roofline", "decode.measured_s.0", "decode step, batch 1, S=128", "ms", 1e3),
    Headline("serving", "throughput.continuous.tokens_per_s", "continuous batching", "tok/s"),
    Headline("serving", "throughput.ratios.continuous_vs_static", "continuous vs static batching", "x"),
    Headline("serving", "throughput.ratios.continuous_vs_hf_generate_batch",
             "continuous batching vs transformers generate_batch", "x"),
    Headline("serving", "stall_ratios.p99_itl_no_chunk_over_chunk",
             "p99 inter-token latency, no chunking / chunked", "x"),
    Headline("spec", "ngram_summary.speedup", "n-gram speculative decoding speedup", "x"),
    Headline("spec", "ngram_summary.acceptance", "n-gram alpha estimate (mean per prompt)", ""),
    Headline("spec", "ngram_summary.hf_speedup", "transformers prompt lookup speedup, same prompts", "x"),
    Headline("spec", "small_batch.speedup", "n-gram speedup, batch of 4 in the engine", "x"),
    Headline("spec", "self_drafts.bf16.summary.measured_over_predicted",
             "bf16 self-draft: measured / predicted speedup", ""),
    Headline("drafting", "batch1.greedy.eagle.tau", "EAGLE-2 tree, tokens per step, batch 1, held-out chat", ""),
    Headline("drafting", "batch1.greedy.eagle.speedup", "EAGLE-2 tree speedup, batch 1, held-out chat", "x"),
    Headline("drafting", "batch1.greedy.medusa.tau", "Medusa tree, tokens per step, batch 1, held-out chat", ""),
    Headline("drafting", "batch1.greedy.lookahead.speedup", "lookahead speedup, batch 1, held-out chat", "x"),
    Headline("drafting", "batch1.greedy.eagle K=1.speedup", "EAGLE chain of 1 speedup, batch 1, held-out chat", "x"),
    Headline("drafting", "batch1.greedy.int4 self-draft.speedup", "int4 self-draft speedup, batch 1, held-out chat", "x"),
    Headline("drafting", "batch_engine.methods.eagle.speedup", "EAGLE chain speedup, batch 4 in the engine", "x"),
    Headline("spec_replay", "speedup", "n-gram speedup, real schedule replayed (weights in record)", "x"),
    Headline("quant", "rows.int4_g32_fast.ms_per_token", "batch-1 decode, int4 g32 weights (fused kernel)", "ms"),
    Headline("quant", "ratios.int4_g32_fast_vs_fp32", "batch-1 decode, int4 g32 vs fp32", "x"),
    Headline("quant", "ratios.int8_fast_vs_fp32", "batch-1 decode, int8 vs fp32", "x"),
    Headline("quant", "ratios.int4_g32_fast_lm_int4_vs_fp32",
             "batch-1 decode, int4 g32 with an int4 lm_head vs fp32", "x"),
    Headline("quant", "rows.int4_g32_fast_lm_int4.fraction_of_floor",
             "batch-1 decode, int4 g32 with an int4 lm_head / its own read floor", "%", 100),
    Headline("quant", "llama_cpp.ratios.int8.tok_per_s_ratio",
             "batch-1 decode, minillm int8 / llama.cpp Q8_0, tok/s in the same rounds", "x"),
    Headline("quant", "llama_cpp.ratios.int4_g32.tok_per_s_ratio",
             "batch-1 decode, minillm int4 g32 / llama.cpp Q4_0, tok/s in the same rounds", "x"),
    Headline("quant", "llama_cpp.ratios.gguf.tok_per_s_ratio",
             "batch-1 decode, minillm gguf / llama.cpp Q4_1 (the shipped file), tok/s in the same rounds", "x"),
    Headline("compile", "timings.0.speedup", "batch-1 decode step, torch.compile vs eager (warm)", "x"),
    Headline("compile", "timings.0.compile_s", "batch-1 decode step, torch.compile's compile time", "s"),
    Headline("compiled_steps", "decode.batch1.compiled_over_eager",
             "batch-1 decode, compiled engine steps vs eager engine", "x"),
    Headline("compiled_steps", "decode.batch8.compiled_vs_transformers",
             "batch-8 decode, compiled engine steps vs transformers", "x"),
    Headline("compiled_steps", "compile_s_cached",
             "compiled steps: a later process loads and checks its 5 sizes", "s"),
    Headline("compiled_steps", "ngram.summarize.ngram_compiled_speedup",
             "n-gram speculation through the engine, compiled steps, vs plain eager (summarize)", "x"),
    Headline("serve_compare", "targets.output_tok_s_ratio_at_saturation",
             "HTTP: minillm vs transformers serve, output tok/s at saturation", "x"),
    Headline("serve_compare_compiled", "targets.output_tok_s_ratio_at_saturation",
             "HTTP: minillm with compiled steps vs transformers serve, output tok/s at saturation", "x"),
    Headline("serve_compare", "targets.ttft_p99_ms_at_half_saturation.minillm",
             "HTTP: TTFT p99 at half of minillm's saturation rate, minillm", "ms"),
    Headline("serve_compare", "targets.ttft_p99_ms_at_half_saturation.transformers",
             "HTTP: TTFT p99 at half of minillm's saturation rate, transformers serve", "ms"),
    Headline("priority", "policies.fcfs.interactive.ttft_p95", "interactive TTFT p95 beside batch traffic, fcfs", "ms", 1e3),
    Headline("priority", "policies.priority.interactive.ttft_p95",
             "interactive TTFT p95 beside batch traffic, priority", "ms", 1e3),
    Headline("attention", "memory.4096.tiled64_over_dense",
             "prefill attention at 4096 tokens: tiled peak memory / materialized", "x"),
    Headline("attention", "timing.2048.dense_over_sdpa",
             "prefill attention at 2048 tokens: materialized / SDPA time", "x"),
    Headline("attention_decode", "decode_attention.rows.5.paged_over_sdpa",
             "decode attention, 8192 tokens, batch 1: paged / SDPA (contiguous)", "x"),
    Headline("attention_decode", "decode_attention.rows.5.flashdec_over_sdpa",
             "decode attention, 8192 tokens, batch 1: flash-decoding / SDPA", "x"),
    Headline("attention_decode", "decode_attention.rows.11.paged_over_sdpa",
             "decode attention, 8192 tokens, batch 8: paged / SDPA (contiguous)", "x"),
    Headline("attention_decode", "decode_attention.rows.11.flashdec_over_sdpa",
             "decode attention, 8192 tokens, batch 8: flash-decoding / SDPA", "x"),
    Headline("cuda_graphs", "eager_ms_per_step", "decode step, eager", "ms"),
    Headline("cuda_graphs", "graph_ms_per_step", "decode step, CUDA graph replay", "ms"),
    Headline("cuda_graphs", "graph_speedup", "CUDA graph speedup (launch overhead)", "x"),
    Headline("parallel", "collectives.timings.0.median_ms",
             "gloo all-reduce of one token's hidden state (2,304 B), 2 processes", "ms"),
    Headline("parallel", "predicted.smollm2_tp3_decode_comm_ms",
             "SmolLM2 TP=3: collectives per decode token, predicted from the fit", "ms"),
    Headline("parallel", "pipeline.by_microbatches.4.bubble_measured",
             "pipeline bubble, 2 stages, 4 micro-batches (GPipe's formula: 0.20)", ""),
    Headline("parallel", "pipeline.decode_ms_per_token.single",
             "decode, batch 4, one process of 1 thread (KV cache)", "ms"),
    Headline("parallel", "pipeline.decode_ms_per_token.p2_m1",
             "decode, batch 4, 2-stage pipeline of 1 thread per stage (KV caches)", "ms"),
    Headline("disaggregation", "layouts.colocated.rows.1.measured.goodput",
             "goodput at 0.5 req/s, long prompts among short chats: colocated (2 threads)", "req/s"),
    Headline("disaggregation", "layouts.disaggregated.rows.1.measured.goodput",
             "the same, disaggregated (prefill and decode, 1 thread each)", "req/s"),
    Headline("disaggregation", "layouts.disaggregated.rows.1.error.goodput",
             "the simulator's goodput error on that run (relative)", "%", 100),
    Headline("disaggregation", "layouts.disaggregated.rows.1.measured.itl_ms.p90",
             "ITL p90 of that run, disaggregated", "ms"),
    Headline("disaggregation", "layouts.colocated.rows.1.measured.itl_ms.p90",
             "ITL p90 of that run, colocated", "ms"),
    Headline("spec_switch", "ratios.low_tpot_off_over_switch",
             "n-gram speculation that steps aside, batch 1: TPOT off / switched", "x"),
    Headline("spec_switch", "ratios.high_decode_tokens_per_s_switch_over_always",
             "the same at 32 running requests: decode tokens/s switched / always-on", "x"),
    Headline("spec_switch", "open.ratios.high_decode_tokens_per_s_switch_over_always",
             "open questions (drafts rarely kept), 32 running: switched / always-on", "x"),
    Headline("slo_control", "mean.controller.goodput",
             "SLO controller under a one-minute load step: goodput (2 rounds, mean)", "req/s"),
    Headline("slo_control", "mean.fixed_{best_fixed_budget}.goodput",
             "the same step, chapter 8's chosen fixed budget ({best_fixed_budget})", "req/s"),
    Headline("kv_tier", "costs.recompute_over_restore",
             "host KV tier: recomputing a block / restoring it from host memory", "x"),
    Headline("kv_tier", "runs.on.host_hit_rate",
             "multi-turn chat, pool too small for the system prompt: host-tier hit rate", "%", 100),
]


def get_metric(record: dict, metric_path: str):
    """Walk `metric_path` through nested dicts/lists; None when any step is missing."""
    node = record
    for key in metric_path.split("."):
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.lstrip("-").isdigit() and -len(node) <= int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def load_ledger(results_dir=None) -> list[dict]:
    """Every benchmark record in the folder, each with `_source` (its file name) added."""
    folder = Path(results_dir) if results_dir is not None else default_results_dir()
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and "benchmark" in record and "machine" in record:
            records.append({**record, "_source": path.name})
    return records


def format_value(x: float, significant: int = 3) -> str:
    """3 significant digits whatever the device: 0.0144 TFLOP/s on a CPU, 51.2 on a GPU."""
    if abs(x) >= 10 ** significant:
        return f"{x:.0f}"
    return f"{x:.{significant}g}"


def _notes(record: dict) -> str:
    notes = []
    if record.get("quick"):
        notes.append("quick")
    if str(record.get("weights", "")).startswith("random"):
        notes.append("random weights")
    return f" ({', '.join(notes)})" if notes else ""


def results_table(records: list[dict], headlines: list[Headline] = HEADLINES) -> str:
    """A markdown table: one row per headline number found in `records`, in `headlines` order."""
    if not isinstance(records, list):
        raise TypeError(f"records must be a list of dicts, got {type(records).__name__}")
    rows = ["| benchmark | metric | value | device | date | commit |",
            "|---|---|---|---|---|---|"]
    for h in headlines:
        matching = [r for r in records if r.get("benchmark") == h.benchmark]
        for r in sorted(matching, key=lambda r: r.get("machine", {}).get("device", "")):
            try:                  # "{key}" in a path or label is filled from the record's top level
                path, label = h.metric_path.format_map(r), h.label.format_map(r)
            except (KeyError, IndexError):
                continue
            value = get_metric(r, path)
            if value is None:
                continue
            m = r.get("machine", {})
            shown = format_value(value * h.scale) + (f" {h.unit}" if h.unit else "")
            rows.append(f"| {h.benchmark} | {label} | {shown}{_notes(r)} | "
                        f"{m.get('device_name', m.get('device', '?'))} | "
                        f"{str(m.get('date', '?'))[:10]} | {str(m.get('git_commit', '?')).split('+')[0]} |")
    if len(rows) == 2:
        rows.append("| - | no results committed yet | - | - | - | - |")
    return "\n".join(rows)


def update_table(path=None, results_dir=None, check: bool = False) -> bool:
    """Rewrite the table between the markers in `path` (default: docs/results.md of this
    checkout) from the records; True when the file changed (with `check`: when it would change,
    and nothing is written)."""
    path = Path(path) if path is not None else RESULTS_PAGE
    text = path.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{path} must hold exactly one {START} followed by one {END}")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    table = results_table(load_ledger(results_dir))
    new = f"{head}{START}\n{table}\n{END}{tail}"
    if new != text and not check:
        path.write_text(new)
    return new != text


def ledger_for(benchmark: str, metric_path: str, results_dir=None, scale: float = 1.0) -> list[dict]:
    """Committed values of one metric on every device, labelled with where they came from.

    >>> for e in ledger_for("decode", "batch1.minillm_tok_per_s"):
    ...     print(e["label"], e["value"])        # e.g. "NVIDIA H200 (decode_h200.json, 2026-11-29)"
    """
    out = []
    for r in load_ledger(results_dir):
        value = get_metric(r, metric_path) if r.get("benchmark") == benchmark else None
        if value is None:
            continue
        m = r["machine"]
        name = m.get("device_name", m.get("device", "?"))
        out.append({"value": value * scale, "device": m.get("device", "?"), "device_name": name,
                    "source": r["_source"], "date": str(m.get("date", "?"))[:10],
                    "commit": m.get("git_commit", "?"), "quick": bool(r.get("quick")),
                    "weights": r.get("weights", "real"),
                    "label": f"{name} ({r['_source']}, {str(m.get('date', '?'))[:10]}){_notes(r)}"})
    return out


def main(argv=None) -> int:
    """`python -m benchmarks.results_table [--check] [PATH]` (PATH default: docs/results.md)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.results_table")
    p.add_argument("path", nargs="?", default=None, help=f"default: {RESULTS_PAGE}")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the table is stale")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    path = Path(a.path) if a.path else RESULTS_PAGE
    if not path.is_file():
        p.error(f"{path} does not exist: the results table lives between {START} and {END} there")
    changed = update_table(path, check=a.check)
    if a.check:
        state = "out of date: run python -m benchmarks.results_table" if changed else "up to date"
        print(f"{path}: results table {state}")
        return int(changed)
    print(f"{path}: results table {'updated' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
