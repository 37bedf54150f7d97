"""CPU matmul routes benchmark (chapter 1): which route wins on this CPU, and what it buys.

One run, on the real model: batch-1 decode ms/token through the tuned table ("auto") and through
every route pinned on its own, transformers' `generate` beside them, and the floor (the weight
bytes over the read bandwidth measured in the same process); then single matmuls of the MLP and
lm_head shapes at 1-8 rows per route; and the tuned plan itself. Written to
benchmarks/results/kernels_<device>.json, so chapter 1 can set two CPUs' tables side by side.
GPUs have one route (F.linear): there the benchmark records that and stops.
"""
from benchmarks.decode import _equal_length_prompts, _ms_per_token, transformers_run
from benchmarks.records import machine_info, write_result
from minillm.kernels.cpu_kernels import ROUTES, linear_route
from minillm.kernels.cpu_tuning import CANDIDATES, accelerate, kernel_report
from minillm.model.generate import generate
from minillm.model.hf_convert import to_hf_model
from minillm.llm import load_model            # the front door: CPU routes switched on
from minillm.analysis.roofline import Hardware
from minillm.lab.measure import measure_bandwidth, skinny_matmul_times

PINNED = [r for r in ROUTES if r != "auto"]


def run(quick: bool = False, device=None, out_dir=None, model=None, tok=None) -> dict:
    if model is None:
        model, tok = load_model(device=device)
    if model.device.type != "cpu":
        return {"skipped": "CPU routes only; CUDA uses F.linear"}
    accelerate(model)                                   # the tuned table (read from the cache)
    n_new, repeat = (4, 1) if quick else (32, 3)
    bandwidth = measure_bandwidth("cpu")
    weight_bytes = model.config.num_params * model.dtype.itemsize
    prompt = _equal_length_prompts(tok, 1)[0]
    def pinned(route):
        def run(n):
            with linear_route(route):
                return generate(model, prompt, n)
        return run
    runs = {route: pinned(route) for route in ["auto"] + PINNED}
    runs["transformers"] = transformers_run(to_hf_model(model), [prompt])
    paths = {k: round(v, 2) for k, v in _ms_per_token(runs, n_new, "cpu", repeat).items()}
    paths["floor"] = round(1e3 * weight_bytes / bandwidth, 2)
    hw = Hardware("this CPU", {"fp32": 1e11}, mem_bandwidth=bandwidth, mem_bytes=1e9)
    rows = (1, 2) if quick else (1, 2, 4, 8)
    cfg = model.config
    matmuls = {}
    for name, (k, n) in {"mlp_up 576x3072": (cfg.d_model, 2 * cfg.d_ff),
                         "lm_head": (cfg.d_model, cfg.vocab_size)}.items():
        t = skinny_matmul_times(hw, k, n, rows, repeats=1 if quick else 3,
                                min_weight_bytes=(16 if quick else 128) * 2**20,
                                routes=CANDIDATES)
        matmuls[name] = {route: {str(r): round(s * 1e3, 4) for r, s in zip(rows, secs)}
                         for route, secs in t.items()}
    record = {"model": cfg.name, "quick": quick, "new_tokens": n_new,
              "units": {"decode_ms_per_token": "ms per batch-1 decode step",
                        "matmul_ms": "ms per (rows, k) @ W^T, weights out of cache"},
              "measured_bandwidth_GBps": round(bandwidth / 1e9, 2),
              "decode_ms_per_token": paths, "matmul_ms": matmuls, "kernels": kernel_report(model)}
    record["machine"] = machine_info("cpu")
    record["path"] = str(write_result("kernels", record, "cpu", out_dir))
    return record


def report(r: dict) -> str:
    if "skipped" in r:
        return f"kernels benchmark skipped: {r['skipped']}"
    p = r["decode_ms_per_token"]
    lines = [f"CPU routes on {r['machine']['cpu']} ({r['machine']['torch_threads']} threads), "
             f"read bandwidth {r['measured_bandwidth_GBps']} GB/s; batch-1 decode ms/token:"]
    for path, ms in p.items():
        lines.append(f"  {path:>12}: {ms:7.1f}  (floor/this = {p['floor'] / ms:.2f})")
    for name, t in r["matmul_ms"].items():
        lines.append(f"  {name}: " + "; ".join(
            f"{route} " + " ".join(f"{k}:{v:.2f}" for k, v in ms.items()) for route, ms in t.items()))
    return "\n".join(lines)
