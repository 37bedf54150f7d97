"""Decode benchmark (chapters 0-1): minillm vs transformers' `generate` on the real model.

Same weights (transformers' LlamaForCausalLM is built from minillm's model), same prompts,
greedy, in one run: batch 1 through `generate`, batch 8 through `LLMEngine` (and
`generate_batch`), against transformers with 1 and 8 rows. Decode time per token is taken as
(t(N new tokens) - t(1 new token)) / (N - 1), so the prompt's prefill is not counted.
The bandwidth floor is the weight bytes one decode step must read divided by the read bandwidth
measured in the same process: no batch-1 decode can beat it. It is measured twice: once before
the runs (`bandwidth_floor_ms`), and as one more run taking its turn in every round of the
batch-1 timing (`batch1.floor_ms_per_step`: one `sum()` over a buffer of the weights' size per
"step"), so the share of the floor compares two times taken at the same moments. On a shared
machine whose speed drifts during the minutes the benchmark takes, only the second is a fair
ratio, and `batch1_fraction_of_floor` uses it. The buffer costs one more copy of the weights'
bytes in memory while the benchmark runs.
The batch-1 rounds time a third run beside them: the step's matmuls alone (`decode_matmuls`:
every projection once, through the same routes, nothing else). No step through these kernels
can be faster, so `batch1_matmuls_fraction_of_floor` (floor / matmuls alone) is the most of the
floor this machine's kernels allow, and the step's time beyond them is everything else (norms,
RoPE, attention, the cache, sampling, Python): what is short of the floor splits in two, measured.

On a CPU the model runs the matmul routes tuned for this machine (`cpu_kernels`, weights stored
once), then again with the routes that may keep a second, prepacked copy of a weight
(`allow_copies=True`), whose extra bytes the record lists. `forward_cost`
(`minillm.lab.forward_cost`) times one forward of 1..64 new tokens after a 128-token context: the
cost curve a decode batch, a speculative verify step and a prefill chunk pay; beside it, in the
same rounds, the same forwards' matmuls alone, and from the two `least_forward_ratio`: how low
forward(N) / forward(1) could go with these kernels if nothing but the matmuls grew with N.
"""
import statistics

import torch
from tqdm.auto import tqdm

from benchmarks.records import machine_info, write_result
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels.cpu_tuning import accelerate, kernel_report
from minillm.lab.common import time_fn
from minillm.lab.forward_cost import COST_ROWS, forward_cost, least_forward_ratio
from minillm.lab.measure import decode_matmuls, measure_bandwidth, measure_hardware
from minillm.lab.verify_cost import VERIFY_ROWS, format_verify_table, verify_table
from minillm.lab.prompts import DECODE_PROMPTS as PROMPTS
from minillm.model.chat import encode_chat
from minillm.model.generate import generate, generate_batch
from minillm.model.hf_convert import to_hf_model
from minillm.llm import load_model            # the front door: CPU routes switched on



def _equal_length_prompts(tok, n: int) -> list[list[int]]:
    ids = [encode_chat(tok, p) for p in PROMPTS[:n]]
    T = min(len(x) for x in ids)
    return [x[-T:] for x in ids]                       # keep the assistant header at the end


@torch.inference_mode()
def _ms_per_token(runs: dict, n_new: int, device, repeat: int) -> dict:
    """{name: ms per decode step} of each `runs[name](n)`, from the median of `repeat` rounds of
    (t(n_new) - t(1)) / (n_new - 1). Every round times every run in turn, so a slow spell of a
    shared machine falls on all of them alike and their ratio holds."""
    for run in runs.values():                          # warm-up: weights and code paths touched
        run(1)
    samples = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            t_n = time_fn(lambda: run(n_new), device, warmup=0, repeat=1)
            t_1 = time_fn(lambda: run(1), device, warmup=0, repeat=1)
            samples[name].append(1e3 * (t_n - t_1) / (n_new - 1))
    return {name: statistics.median(ms) for name, ms in samples.items()}


def transformers_run(hf, prompts: list[list[int]]):
    """n -> transformers' greedy `generate` of exactly n new tokens for equal-length prompts."""
    x = torch.tensor(prompts, device=hf.device)
    return lambda n: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)


def floor_run(nbytes: int, device):
    """n -> n reads of an fp32 buffer of `nbytes` (one `sum()` each): timed like a decode run,
    (t(n) - t(1)) / (n - 1) is one read of that many bytes at this moment."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return lambda n: [buf.sum() for _ in range(n)]


def matmuls_run(model):
    """n -> the matmuls of n batch-1 decode steps and nothing else (`decode_matmuls`), timed like
    a decode run."""
    step = decode_matmuls(model, 1)
    return lambda n: [step() for _ in range(n)]


def _decode_rows(model, tok, hf, n_new, repeat, floor=None) -> dict:
    """ms per decode step at batch 1 and 8: minillm (generate, the engine, generate_batch) and
    transformers; batch 1 also times its matmuls alone and, with `floor` (a `floor_run`), the
    floor, in the same rounds."""
    device, out = model.device, {}
    for batch in (1, 8):
        prompts = _equal_length_prompts(tok, batch)
        theirs = transformers_run(hf, prompts)
        extra = {"matmuls": matmuls_run(model)} if batch == 1 else {}
        if batch == 1 and floor is not None:
            extra["floor"] = floor
        if batch == 1:
            ours = {"generate": lambda n: generate(model, prompts[0], n)}
        else:
            engine = LLMEngine(model, EngineConfig(max_num_seqs=8, kv_cache_memory_bytes=64 * 2**20))
            ours = {"engine": lambda n: engine.generate(
                        prompts, SamplingParams(max_tokens=n, ignore_eos=True)),
                    "generate_batch": lambda n: generate_batch(model, prompts, n)}
        ms = _ms_per_token({**ours, "transformers": theirs, **extra}, n_new, device, repeat)
        ms_hf, floor_ms = ms.pop("transformers"), ms.pop("floor", None)
        matmuls_ms = ms.pop("matmuls", None)
        row = {f"minillm_{k}_ms_per_step": round(v, 3) for k, v in ms.items()}
        if matmuls_ms is not None:
            row["matmuls_ms_per_step"] = round(matmuls_ms, 3)
        if floor_ms is not None:
            row["floor_ms_per_step"] = round(floor_ms, 3)
        best = row[f"minillm_{next(iter(ours))}_ms_per_step"]
        row.update(minillm_ms_per_step=best, transformers_ms_per_step=round(ms_hf, 3),
                   minillm_tok_per_s=round(1e3 * batch / best, 2),
                   transformers_tok_per_s=round(1e3 * batch / ms_hf, 2),
                   speedup_vs_transformers=round(ms_hf / best, 3))
        out[f"batch{batch}"] = row
    return out


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None) -> dict:
    """Measure and write <results_dir()>/decode_<device>.json; return the record."""
    if model is None:
        model, tok = load_model(device=device)
    device = model.device
    hf = to_hf_model(model)
    n_new, repeat = (8, 1) if quick else (64, 5)
    rows = COST_ROWS[:3] if quick else COST_ROWS
    bandwidth = measure_bandwidth(device)
    weight_bytes = model.config.num_params * model.dtype.itemsize
    floor_ms = 1e3 * weight_bytes / bandwidth
    floor = floor_run(weight_bytes, device)
    hardware = measure_hardware(device, quick=quick, dtypes=(str(model.dtype).replace("torch.", ""),),
                                progress=False)          # the roofline of the verify-cost table
    record = {"model": model.config.name, "dtype": str(model.dtype).replace("torch.", ""),
              "quick": quick, "new_tokens": n_new,
              "units": {"ms_per_step": "ms per decode step", "tok_per_s": "generated tokens/s",
                        "bandwidth": "GB/s",
                        "bandwidth_floor_ms": "ms, from the bandwidth measured before the runs",
                        "floor_ms_per_step": "ms per read of the weights' bytes, timed in turn "
                                             "with the batch-1 runs",
                        "batch1_fraction_of_floor": "floor_ms_per_step / batch-1 ms per step",
                        "matmuls_ms_per_step": "ms of one batch-1 step's matmuls alone, timed in "
                                               "turn with the batch-1 runs",
                        "batch1_matmuls_fraction_of_floor": "floor_ms_per_step / matmuls_ms_per_step: "
                                                            "the most of the floor these kernels allow",
                        "forward_cost": "ms per forward of N new tokens (128 cached); 'matmuls': "
                                        "its matmuls alone at N rows, same rounds",
                        "least_forward_ratio": "N -> 1 + (matmuls(N) - matmuls(1)) / forward(1): "
                                               "the least forward(N) / forward(1) these kernels allow",
                        "verify_cost": "verify_table: per N, forward ms (128 cached, logits at every "
                                       "position), ratio to N = 1, the least ratio these kernels "
                                       "allow, the roofline's ratio, gap = ratio / least - 1, and "
                                       "the attention alone; stored_once also the int8 dynamic "
                                       "route's least ratio"},
              "measured_bandwidth_GBps": round(bandwidth / 1e9, 2),
              "weight_bytes": weight_bytes, "bandwidth_floor_ms": round(floor_ms, 3)}
    configs = {"stored_once": False, "with_copies": True} if device.type == "cpu" else {"cuda": None}
    for name, copies in tqdm(configs.items(), desc="decode benchmark"):
        if copies is not None:
            accelerate(model, allow_copies=copies)
        part = _decode_rows(model, tok, hf, n_new, repeat, floor)
        part["forward_cost"] = forward_cost(model, rows=rows, rounds=1 if quick else 5,
                                            routes=("auto", "F.linear") if copies is False else ("auto",),
                                            matmuls=True)
        part["least_forward_ratio"] = least_forward_ratio(part["forward_cost"])
        part["verify_cost"] = verify_table(model, rows=VERIFY_ROWS[:3] if quick else VERIFY_ROWS,
                                           rounds=1 if quick else 5, hardware=hardware,
                                           int8=copies is False)
        b1 = part["batch1"]
        part["batch1_fraction_of_floor"] = round(b1["floor_ms_per_step"] / b1["minillm_ms_per_step"], 3)
        part["batch1_matmuls_fraction_of_floor"] = round(b1["floor_ms_per_step"]
                                                         / b1["matmuls_ms_per_step"], 3)
        part["kernels"] = kernel_report(model) if copies is not None else {}
        record[name] = part
    main = record[next(iter(configs))]
    del floor                                               # the buffer's memory back
    record.update(batch1=main["batch1"], batch8=main["batch8"], forward_cost=main["forward_cost"],
                  batch1_fraction_of_floor=main["batch1_fraction_of_floor"],
                  batch1_matmuls_fraction_of_floor=main["batch1_matmuls_fraction_of_floor"],
                  least_forward_ratio=main["least_forward_ratio"], verify_cost=main["verify_cost"])
    if device.type == "cpu":
        accelerate(model)                                   # leave the default routes behind
    record["machine"] = machine_info(device)
    record["path"] = str(write_result("decode", record, device, out_dir))
    return record


def report(r: dict) -> str:
    m = r["machine"]
    lines = [f"decode benchmark on {m.get('device_name', m['device'])} ({m['torch_threads']} threads): "
             f"{r['model']} {r['dtype']}, read bandwidth {r['measured_bandwidth_GBps']} GB/s, "
             f"floor {r['bandwidth_floor_ms']:.1f} ms/token"]
    for name in ("stored_once", "with_copies", "cuda"):
        if name not in r:
            continue
        part = r[name]
        extra = part.get("kernels", {}).get("extra_bytes", 0)
        lines.append(f" {name} (extra weight bytes: {extra / 1e6:.0f} MB):")
        for b in ("batch1", "batch8"):
            x = part[b]
            lines.append(f"  {b}: minillm {x['minillm_ms_per_step']:.1f} ms/step "
                         f"({x['minillm_tok_per_s']:.1f} tok/s), transformers "
                         f"{x['transformers_ms_per_step']:.1f} ms/step -> "
                         f"{x['speedup_vs_transformers']:.2f}x")
        fl = part["batch1"].get("floor_ms_per_step")
        lines.append(f"  batch-1 decode step = {100 * part['batch1_fraction_of_floor']:.0f}% of the "
                     f"floor's speed (the floor is {part['batch1_fraction_of_floor']:.2f}x the step time"
                     + (f"; one read of the weights took {fl:.1f} ms in the same rounds)" if fl else ")"))
        mm = part["batch1"].get("matmuls_ms_per_step")
        if mm and "batch1_matmuls_fraction_of_floor" in part:
            step = part["batch1"]["minillm_ms_per_step"]
            lines.append(f"  its matmuls alone: {mm:.1f} ms = {100 * part['batch1_matmuls_fraction_of_floor']:.0f}% "
                         f"of the floor's speed, the most these kernels allow; everything else "
                         f"{step - mm:.1f} ms")
        for route, cost in part["forward_cost"].items():
            one = cost["1"]
            what = "its matmuls alone" if route == "matmuls" else f"forward of N tokens, {route}"
            lines.append(f"  {what:>29} / of 1 token: "
                         + " ".join(f"{n}:{ms / one:.2f}" for n, ms in cost.items())
                         + f" (1 token {one:.0f} ms)")
        if "least_forward_ratio" in part:
            lines.append("  the least forward(N) / forward(1) these kernels allow: "
                         + " ".join(f"{n}:{v:.2f}" for n, v in part["least_forward_ratio"].items()))
        if "verify_cost" in part:
            lines.append("  verify cost, forward(N) / forward(1), against the least and the roofline:")
            lines += ["    " + line for line in format_verify_table(part["verify_cost"]).splitlines()]
    return "\n".join(lines)
