"""Quantized roofline (chapter 7): batch-1 decode of the real model per weight format and path.

Formats: fp32 (as `load_model` gives it, the CPU routes tuned for this machine), bf16, int8 per
channel, int4 in groups of 32 (round-to-nearest) and "gguf" (the shipped Q4_1 blocks; the same
numbers as int4 g32 here, read from the file instead). Each quantized one runs this machine's
chosen fast route (`quant/routes.py`; "int8_w8a8" lets int8 race its W8A8 route), once with the fp32
embedding as lm_head and once with a quantized lm_head (int8 for int8, int4 g32 for the others),
and the dequantize-then-matmul reference. Each row's floor is the bytes ITS step reads
(`quantized_bytes(model)["read_per_step"]`: the kernels' packed copies where they read those,
the quantized lm_head instead of the 113 MB fp32 table) over the read bandwidth measured in the
same process; "of floor" is floor / ms. Agreement: the share of positions of a held-out
paragraph where the model's argmax equals fp32's (one teacher-forced pass). ms/token is
(t(N new tokens) - t(1)) / (N - 1), as in `benchmarks/decode.py`, so the prefill is not counted; each
time is the fastest of a few runs, and the bandwidth the higher of two measurements.

Targets (reported, not asserted): int4 >= 3x fp32 decode, each format >= 70% of its floor.

A peer, llama.cpp (`benchmarks/quant_llama_cpp.py`; the `compare` extra installs it): its Q8_0,
Q4_0 and the shipped Q4_1 file run the same greedy decode of the same prompt ids at the same
thread count, in rounds that alternate them with minillm's fp32, int8, int4 g32 and gguf (each with
an lm_head of the bits llama.cpp's output table has), the fastest of the rounds kept as above.
Each row says tok/s and GB/s (its bytes read per token x tok/s), and a table sets each minillm
format beside its llama.cpp match: int8 and Q8_0, int4 g32 and Q4_0, gguf and Q4_1. The Q8_0 and
Q4_0 files are made from the Q4_1 one, so they say nothing about quality. Without llama_cpp the
peer is skipped: `"llama_cpp": {"skipped": why}` in the record, one line in the report.
A run at a thread count other than the course's one writes quant_threads<N>_<device>.json, so
the record the chapters quote keeps the course's policy.

Left out on purpose: batch > 1 (the kernels' cost curve), gptq / awq (same format and speed as
int4: only the numbers in the weights differ), KV-cache formats.
"""
import copy
import gc
import time

import torch

from benchmarks import quant_llama_cpp as peer
from benchmarks.records import machine_info, write_result
from minillm.lab.common import sync
from minillm.lab.machine import COURSE_THREADS
from minillm.lab.measure import measure_bandwidth
from minillm.model.chat import encode_chat
from minillm.model.generate import generate
from minillm.llm import load_model            # the front door: CPU routes switched on
from minillm.quant.api import quantize, quantized_bytes, set_path
from minillm.quant.quality import eval_ids

PROMPT = "Explain how a CPU cache works."
QUANTIZED = {"int8": dict(method="int8"), "int8_w8a8": dict(method="int8", allow_w8a8=True),
             "int4_g32": dict(method="int4", group_size=32), "gguf": dict(method="gguf")}
HEAD = {"int8": "int8", "int8_w8a8": "int8", "int4_g32": "int4", "gguf": "int4"}     # the quantized lm_head per format
FLOOR_TARGET, INT4_TARGET = 0.70, 3.0


def _decode_ms(runs: dict, n_new: int, repeat: int, device) -> dict:
    """{name: ms per decode step} of each `runs[name](n)` (n new tokens after the prompt):
    (t(n_new) - t(1)) / (n_new - 1), each t the fastest of `repeat` rounds. Every round times
    every run in turn, so a slow spell of a shared machine falls on all of them (and interference
    only ever adds time)."""
    def timed(run, n):
        sync(device)
        t0 = time.perf_counter()
        run(n)
        sync(device)
        return time.perf_counter() - t0
    for run in runs.values():
        run(2)                                                  # warm-up: probes, allocations
    t_n, t_1 = dict.fromkeys(runs, float("inf")), dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            t_n[name] = min(t_n[name], timed(run, n_new))
            t_1[name] = min(t_1[name], timed(run, 1))
    return {name: round(1e3 * (t_n[name] - t_1[name]) / (n_new - 1), 2) for name in runs}


@torch.inference_mode()
def _time(model, prompt, n_new, repeat) -> float:
    """ms per decode step of minillm's `generate` on `model` (`_decode_ms` with one run)."""
    return _decode_ms({"model": lambda n: generate(model, prompt, n)}, n_new, repeat, model.device)["model"]


def _row(model, bandwidth, prompt, n_new, repeat, path=None) -> dict:
    ms = _time(model, prompt, n_new, repeat)
    counted = quantized_bytes(model)                 # after the run: fast-path copies exist now
    nbytes = counted["read_per_step"]
    floor = 1e3 * nbytes / bandwidth
    row = {"read_bytes": nbytes, "weight_bytes": counted["total"], "floor_ms": round(floor, 3),
           "ms_per_token": ms, "fraction_of_floor": round(floor / ms, 3),
           "fast_path_copy_bytes": counted.get("fast_path_copies", 0)}
    if path is not None:
        kinds = {m.route if m.active_path() == "fast" else "reference"
                 for m in model.modules() if hasattr(m, "active_path")}
        row["path"] = path if path == "reference" else "+".join(sorted(kinds))
    return row


@torch.inference_mode()
def _argmax(model, ids):
    return model(ids.to(model.device)).argmax(-1).cpu()                   # (B, T)


def _agreement(model, ids, ref) -> float:
    return round((_argmax(model, ids) == ref).float().mean().item(), 4)


@torch.inference_mode()
def _llama_cpp_peer(model, prompt, n_new: int, rounds: int) -> dict:
    """llama.cpp's Q8_0 / Q4_0 / Q4_1 files beside minillm's fp32 and its int8 / int4 g32 / gguf
    formats (each with the lm_head bits of llama.cpp's output table), the same prompt, threads
    and token count, timed in the same alternated rounds (`benchmarks/quant_llama_cpp.py`).
    Without llama_cpp, or on a GPU: {"skipped": why}, the one line `report` prints for it."""
    reason = peer.unavailable()
    if reason is None and model.device.type != "cpu":
        reason = f"the peer runs llama.cpp's CPU build; this run's device is {model.device.type}"
    if reason is not None:
        return {"skipped": reason}
    import llama_cpp
    threads = torch.get_num_threads()
    files, not_made = peer.peer_files(threads)
    counted = {kind: peer.read_bytes_per_token(peer.tensor_list(path)) for kind, path in files.items()}
    runs, models = {"minillm fp32": lambda n: generate(model, prompt, n)}, {"minillm fp32": model}
    heads = {}
    for fmt, kind in peer.PAIRS.items():
        if kind in files:
            head = peer.head_for(counted[kind]["lm_head_type"])
            q = quantize(copy.deepcopy(model), **QUANTIZED[fmt], lm_head=head)
            models[f"minillm {fmt}"], heads[f"minillm {fmt}"] = q, head
            runs[f"minillm {fmt}"] = lambda n, q=q: generate(q, prompt, n)
    for kind, path in files.items():
        runs[f"llama.cpp {kind}"] = peer.greedy_run(path, prompt, threads, n_new)
    ms = _decode_ms(runs, n_new, rounds, model.device)
    rows = {}
    for name, t in ms.items():
        kind = name.removeprefix("llama.cpp ")
        nbytes = (quantized_bytes(models[name])["read_per_step"] if name in models  # copies exist now
                  else counted[kind]["read_per_token"])
        rows[name] = {"ms_per_token": t, "tok_per_s": round(1e3 / t, 2), "read_bytes": nbytes,
                      "GBps": round(nbytes / t / 1e6, 2)}
        if name in heads:
            rows[name]["lm_head"] = heads[name]
        if name not in models:
            rows[name].update(file=files[kind].name, made_from=None if kind == peer.SHIPPED else peer.SHIPPED,
                              lm_head_type=counted[kind]["lm_head_type"],
                              bytes_by_type=counted[kind]["bytes_by_type"])
    del models, runs
    gc.collect()
    return {"llama_cpp_python": llama_cpp.__version__, "threads": threads, "rounds": rounds,
            "new_tokens": n_new, "rows": rows, "not_made": not_made,
            "ratios": peer.ratio_rows(rows, peer.PAIRS),
            "made_files": f"{', '.join(peer.MADE)} were made from the shipped {peer.SHIPPED} file: "
                          "valid for speed, not for quality"}


def record_name(device, threads: int) -> str:
    """"quant", or "quant_threads<N>" for a CPU run at a thread count other than the course's."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    cpu = torch.device(device).type == "cpu"
    return f"quant_threads{threads}" if cpu and threads != COURSE_THREADS else "quant"


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None) -> dict:
    """Measure and write benchmarks/results/quant_<device>.json (quant_threads<N>_cpu.json at a
    thread count other than the course's one); return the record."""
    if model is None:
        model, tok = load_model(device=device)
    n_new, repeat = (6, 1) if quick else (32, 3)
    n_ref = 3 if quick else 5                # the reference dequantizes every weight every step
    prompt = encode_chat(tok, PROMPT)
    bandwidth = max(measure_bandwidth(model.device) for _ in range(2))
    held_out = eval_ids(tok, 1, 64 if quick else 256)                     # (1, T)
    ref_argmax = _argmax(model, held_out)
    rows = {"fp32": _row(model, bandwidth, prompt, n_new, repeat)}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    rows["bf16"] = _row(bf16, bandwidth, prompt, n_new, repeat)
    del bf16
    for name, kwargs in QUANTIZED.items():
        for head in (None, HEAD[name]):
            q = quantize(copy.deepcopy(model), **kwargs, lm_head=head)
            key = f"{name}_fast" + (f"_lm_{head}" if head else "")
            rows[key] = _row(q, bandwidth, prompt, n_new, repeat, path="auto")
            rows[key]["agreement_with_fp32"] = _agreement(q, held_out, ref_argmax)
            if head is None and (not quick or name == "int4_g32") and name != "int8_w8a8":
                rows[f"{name}_reference"] = _row(set_path(q, "reference"), bandwidth, prompt,
                                                 n_ref, min(repeat, 2), path="reference")
            del q
            gc.collect()
    ms = {k: v["ms_per_token"] for k, v in rows.items()}
    ratios = {f"{k}_vs_fp32": ms["fp32"] / v for k, v in ms.items() if "_fast" in k}
    ratios.update({"int4_g32_fast_vs_bf16": ms["bf16"] / ms["int4_g32_fast"],
                   "gguf_fast_vs_bf16": ms["bf16"] / ms["gguf_fast"],
                   "int4_g32_reference_vs_fast": ms["int4_g32_reference"] / ms["int4_g32_fast"]})
    fast = {k: v for k, v in rows.items() if "_fast" in k}
    targets = {"int4_vs_fp32": round(max(ratios[k] for k in ratios
                                         if k.startswith("int4_g32_fast") and k.endswith("_vs_fp32")), 3),
               "int4_at_least_3x_fp32": max(ratios[k] for k in ratios
                                            if k.startswith("int4_g32_fast") and k.endswith("_vs_fp32")) >= INT4_TARGET,
               "every_format_at_least_70pct_of_floor": all(
                   max(v["fraction_of_floor"] for k, v in fast.items() if k.startswith(n))
                   >= FLOOR_TARGET for n in QUANTIZED)}
    record = {"model": model.config.name, "quick": quick, "new_tokens": n_new,
              "new_tokens_reference": n_ref, "prompt_tokens": len(prompt),
              "measured_bandwidth_GBps": round(bandwidth / 1e9, 2), "rows": rows,
              "ratios": {k: round(v, 3) for k, v in ratios.items()}, "targets": targets,
              "units": {"ms_per_token": "ms per batch-1 decode step", "floor_ms": "read bytes / "
                        "measured read bandwidth", "read_bytes": "bytes one step reads (kernel "
                        "copies where read, the lm_head as used)", "weight_bytes": "bytes of "
                        "every weight held, the fp32 embedding included"}}
    record["units"].update(llama_cpp="llama_cpp.rows: ms_per_token and tok_per_s of greedy batch-1 "
                           "decode in alternated rounds; read_bytes per token (llama.cpp: from the "
                           "GGUF tensor list); GBps = read_bytes x tok/s / 1e9")
    record["llama_cpp"] = _llama_cpp_peer(model, prompt, n_new, 2 if quick else 5)
    record["machine"] = machine_info(model.device)
    name = record_name(model.device, record["machine"]["torch_threads"])
    record["path"] = str(write_result(name, record, model.device, out_dir))
    return record


def report(r: dict) -> str:
    m = r["machine"]
    lines = [f"quantized decode on {m.get('device_name', m['device'])} ({m['torch_threads']} "
             f"threads), read bandwidth {r['measured_bandwidth_GBps']} GB/s, batch 1:",
             f"  {'format':<24}{'read MB':>8}{'floor ms':>10}{'ms/token':>10}{'of floor':>10}"
             f"{'agree':>7}  path"]
    for name, row in r["rows"].items():
        agree = row.get("agreement_with_fp32")
        lines.append(f"  {name:<24}{row.get('read_bytes', row['weight_bytes']) / 1e6:>8.1f}"
                     f"{row['floor_ms']:>10.2f}{row['ms_per_token']:>10.2f}"
                     f"{100 * row['fraction_of_floor']:>9.0f}%"
                     f"{'' if agree is None else f'{agree:.3f}':>7}  {row.get('path', '')}")
    lines += [f"  {k}: {v:.2f}x" for k, v in r["ratios"].items()]
    t = r.get("targets", {})
    if t:
        lines.append(f"  targets: int4 {t['int4_vs_fp32']:.2f}x fp32 (>= 3x: "
                     f"{'met' if t['int4_at_least_3x_fp32'] else 'not met'}); every format >= 70% "
                     f"of its floor: {'met' if t['every_format_at_least_70pct_of_floor'] else 'not met'}")
    lines.append(_report_peer(r.get("llama_cpp", {"skipped": "not measured (an older record)"})))
    return "\n".join(lines)


def _report_peer(p: dict) -> str:
    if "skipped" in p:
        return f"  llama.cpp peer skipped: {p['skipped']}"
    lines = [f"  llama.cpp peer (llama-cpp-python {p['llama_cpp_python']}, {p['threads']} threads, "
             f"fastest of {p['rounds']} alternated rounds, {p['new_tokens']} tokens):",
             f"  {'run':<20}{'read MB':>8}{'ms/token':>10}{'tok/s':>8}{'GB/s':>7}"]
    for name, row in p["rows"].items():
        lines.append(f"  {name:<20}{row['read_bytes'] / 1e6:>8.1f}{row['ms_per_token']:>10.2f}"
                     f"{row['tok_per_s']:>8.1f}{row['GBps']:>7.2f}")
    lines += [peer.format_ratio_table(p["ratios"]), f"  {p['made_files']}"]
    lines += [f"  not made: {kind}: {why}" for kind, why in p.get("not_made", {}).items()]
    return "\n".join(lines)
