"""Decode benchmark (chapter 0): minillm vs transformers' `generate` on the real model.

Same weights (transformers' LlamaForCausalLM is built from minillm's model), same prompts,
greedy, batch 1 and batch 8, in one run. Decode time per token is taken as
(t(N new tokens) - t(1 new token)) / (N - 1), so the prompt's prefill is not counted.
The bandwidth floor is the weight bytes one decode step must read divided by the measured
memory read bandwidth: no batch-1 decode can beat it.

`forward_cost` times one forward of 1..64 new tokens after a 128-token context through each CPU
route of `minillm.model.Linear` ("auto" is the default: skinny for 1-4 rows, prepacked beyond):
the cost curve a decode batch, a speculative verify step and a prefill chunk pay, and the evidence
for the routes on the machine that runs it.
"""
import statistics
import time

import torch
from tqdm.auto import tqdm

from .benchutil import time_fn, write_result
from .chat import encode_chat
from .generate import generate, generate_batch
from .hf_convert import to_hf_model
from .kv_cache import KVCache
from .loading import load_model
from .model import ROUTES, linear_route
from .roofline_measure import measure_bandwidth

PROMPTS = ["Explain how a CPU cache works.", "Write a haiku about the sea.",
           "What is the capital of France?", "Give three tips for learning to cook.",
           "Why is the sky blue?", "Summarize the plot of Hamlet.",
           "How do vaccines work?", "Describe a cat to someone who has never seen one."]


def _equal_length_prompts(tok, n: int) -> list[list[int]]:
    ids = [encode_chat(tok, p) for p in PROMPTS[:n]]
    T = min(len(x) for x in ids)
    return [x[-T:] for x in ids]                       # keep the assistant header at the end


@torch.inference_mode()
def _ms_per_token(run, n_new: int, device, repeat: int) -> float:
    t_n = time_fn(lambda: run(n_new), device, warmup=1, repeat=repeat)
    t_1 = time_fn(lambda: run(1), device, warmup=1, repeat=repeat)
    return 1e3 * (t_n - t_1) / (n_new - 1)


@torch.inference_mode()
def forward_cost(model, rows=(1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 33, 64), context: int = 128,
                 rounds: int = 5, routes=ROUTES) -> dict:
    """Median ms of one forward over `rows` new tokens through each `Linear` route
    (minillm.model.ROUTES); rounds interleave every case so drift spreads evenly."""
    cache = KVCache(model.config, 1, context + max(rows), model.device, model.dtype)
    model(torch.ones(1, context, dtype=torch.long, device=model.device), cache=cache)
    samples = {(r, n): [] for r in routes for n in rows}
    for _ in range(rounds):
        for (route, n), times in samples.items():
            cache.truncate(context)
            x = torch.ones(1, n, dtype=torch.long, device=model.device)
            with linear_route(route):
                t0 = time.perf_counter()
                model(x, cache=cache)
                times.append(1e3 * (time.perf_counter() - t0))
    return {r: {str(n): round(statistics.median(samples[(r, n)]), 2) for n in rows} for r in routes}


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None) -> dict:
    """Measure and write benchmarks/results/decode_<device>.json; return the record."""
    if model is None:
        model, tok = load_model(device=device)
    device = model.device
    hf = to_hf_model(model)
    n_new, repeat = (8, 1) if quick else (64, 3)
    bandwidth = measure_bandwidth(device)
    weight_bytes = model.config.num_params * model.dtype.itemsize
    floor_ms = 1e3 * weight_bytes / bandwidth
    rows = {}
    for batch in tqdm([1, 8], desc="decode benchmark"):
        prompts = _equal_length_prompts(tok, batch)
        x = torch.tensor(prompts, device=device)
        if batch == 1:
            ours = lambda n: generate(model, prompts[0], n)
        else:
            ours = lambda n: generate_batch(model, prompts, n)
        theirs = lambda n: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        ms_ours = _ms_per_token(ours, n_new, device, repeat)
        ms_hf = _ms_per_token(theirs, n_new, device, repeat)
        rows[f"batch{batch}"] = {
            "minillm_ms_per_step": round(ms_ours, 3), "transformers_ms_per_step": round(ms_hf, 3),
            "minillm_tok_per_s": round(1e3 * batch / ms_ours, 2),
            "transformers_tok_per_s": round(1e3 * batch / ms_hf, 2),
            "speedup_vs_transformers": round(ms_hf / ms_ours, 3)}
    b1 = rows["batch1"]["minillm_ms_per_step"]
    record = {"model": model.config.name, "dtype": str(model.dtype).replace("torch.", ""),
              "quick": quick, "new_tokens": n_new,
              "units": {"ms_per_step": "ms per decode step", "tok_per_s": "generated tokens/s",
                        "bandwidth": "GB/s", "bandwidth_floor_ms": "ms"},
              "measured_bandwidth_GBps": round(bandwidth / 1e9, 2),
              "weight_bytes": weight_bytes, "bandwidth_floor_ms": round(floor_ms, 3),
              "batch1_fraction_of_floor": round(floor_ms / b1, 3), **rows}
    if device.type == "cpu":
        record["forward_cost"] = (forward_cost(model, rows=(1, 2, 9), rounds=1) if quick
                                  else forward_cost(model, rounds=5))
        record["units"]["forward_cost"] = "ms per forward of N new tokens (128 cached)"
    record["path"] = str(write_result("decode", record, device, out_dir))
    return record


def report(r: dict) -> str:
    lines = [f"decode benchmark: {r['model']} {r['dtype']}, bandwidth {r['measured_bandwidth_GBps']} GB/s, "
             f"floor {r['bandwidth_floor_ms']:.1f} ms/token"]
    for b in ("batch1", "batch8"):
        x = r[b]
        lines.append(f"  {b}: minillm {x['minillm_ms_per_step']:.1f} ms/step ({x['minillm_tok_per_s']:.1f} tok/s), "
                     f"transformers {x['transformers_ms_per_step']:.1f} ms/step -> "
                     f"{x['speedup_vs_transformers']:.2f}x")
    lines.append(f"  batch-1 decode reaches {100 * r['batch1_fraction_of_floor']:.0f}% of the bandwidth floor")
    for route, cost in r.get("forward_cost", {}).items():
        one = cost["1"]
        lines.append(f"  forward of N tokens / of 1 token, {route:>9}: "
                     + " ".join(f"{n}:{ms / one:.2f}" for n, ms in cost.items()) + f" (1 token {one:.0f} ms)")
    return "\n".join(lines)
