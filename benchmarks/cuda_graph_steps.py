"""Piecewise CUDA graphs in the engine (chapter 1, chapter 4; GPU only): what a step of N rows
costs eager and replayed, and decode through `LLMEngine` at batch 1, 8 and 64 with and without
graphs, beside the bandwidth floor of the same step, in one run.

    python -m benchmarks cuda_graph_steps [--quick] [--out DIR]

The model is `bench_model`'s (SmolLM2-135M in bf16; random weights of its shapes where the real
ones are not installed, said in "weights"). The graph engine's `CompilationConfig` uses the
default rule (a size is kept where it agrees and wins); its judging of every size, a decode step
of N rows after 64 cached tokens each, eager against the L + 1 replays and L eager attentions,
is the per-size table. The engines decode `n_new` tokens per request after 32-token prompts;
`_ms_per_token` times them in turn in the same rounds, with one read of the weights
(`floor_run`) beside them. The floor per step is the bytes a step must read (the weights, every
request's cached K/V) over the measured bandwidth. --quick: 16 new tokens, 3 rounds.
On a machine without CUDA it writes nothing and returns {"skipped": reason}. Left out on purpose:
compiled pieces inside the graphs, prefill-heavy steps, several GPUs.
"""
import torch

from benchmarks.decode import _ms_per_token, floor_run
from benchmarks.gpu_model import bench_model
from benchmarks.records import write_result
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.kernels.compilation_config import CompilationConfig
from minillm.lab.measure import measure_bandwidth
from minillm.model.loading import default_device

SIZES = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 8, 64)
PROMPT = 32


def run(quick: bool = False, device=None, out_dir=None) -> dict:
    """Benchmark entry point (`python -m benchmarks` protocol): writes cuda_graph_steps_<gpu>.json."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda" or not torch.cuda.is_available():
        print("cuda_graph_steps: skipped, CUDA graphs need a CUDA device")
        return {"benchmark": "cuda_graph_steps", "skipped": "CUDA graphs need a CUDA device"}
    model, _, weights = bench_model(device)                   # bf16 on cuda
    record = measure(model, (16, 3) if quick else (64, 5), measure_bandwidth(device))
    record.update(quick=quick, weights=weights)
    record["path"] = str(write_result("cuda_graph_steps", record, device, out_dir))
    return record


def measure(model, rounds: tuple, bandwidth: float, keep: str = "faster") -> dict:
    """The record's figures: `rounds` is (new tokens per request, rounds); `keep` the graph
    engine's rule (a CPU rehearsal with `EagerGraph` keeps "agreeing" sizes)."""
    cfg, device, (n_new, repeat) = model.config, model.device, rounds
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * model.dtype.itemsize
    kv_bytes = 2 * max(BATCHES) * (PROMPT + n_new + 16) * kv_per_token     # twice what runs
    base = dict(max_num_seqs=max(BATCHES), max_num_batched_tokens=256, kv_cache_memory_bytes=kv_bytes)
    eager = LLMEngine(model, EngineConfig(**base))
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    graphs = LLMEngine(model, EngineConfig(**base, compilation_config=CompilationConfig(
        compile_sizes=SIZES, rounds=7, keep=keep)))           # piecewise: the default on cuda
    graph_bytes = torch.cuda.memory_allocated(device) - before if cuda else None
    steps = graphs.runner.compiled
    if steps is None:
        raise RuntimeError("the graph engine kept no size: see the line above on stderr")
    g = torch.Generator().manual_seed(0)
    decode = {}
    for batch in BATCHES:
        prompts = torch.randint(cfg.vocab_size, (batch, PROMPT), generator=g).tolist()
        params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)    # noqa: E731
        ms = _ms_per_token({"eager": lambda n: eager.generate(prompts, params(n)),
                            "graphs": lambda n: graphs.generate(prompts, params(n)),
                            "weights_read": floor_run(weight_bytes, device)},
                           n_new, device, repeat)
        step_bytes = weight_bytes + batch * (PROMPT + n_new / 2) * kv_per_token
        floor_ms = 1e3 * step_bytes / bandwidth
        decode[f"batch{batch}"] = {f"{k}_ms_per_step": round(v, 4) for k, v in ms.items()} | {
            "floor_ms_per_step": round(floor_ms, 4), "padded_to": steps.padded(batch),
            "graphs_over_eager": round(ms["eager"] / ms["graphs"], 3),
            "eager_over_floor": round(ms["eager"] / floor_ms, 2),
            "graphs_over_floor": round(ms["graphs"] / floor_ms, 2)}
    return {"model": cfg.name, "dtype": str(model.dtype), "prompt_tokens": PROMPT,
            "new_tokens": n_new, "bandwidth": bandwidth, "weight_bytes": weight_bytes,
            "graph_bytes": graph_bytes, "steps": steps.as_dict(), "summary": steps.summary(),
            "decode": decode,
            "units": {"steps.timings": "per size: eager_ms and compiled_ms (the graphs) per "
                                       "decode step of N rows, 64 cached tokens each",
                      "*_ms_per_step": "ms per decode step through the engine (all requests)",
                      "weights_read_ms_per_step": "one read of the weights, timed in the rounds",
                      "floor_ms_per_step": "(weights + cached K/V bytes) / measured bandwidth",
                      "graph_bytes": "GPU memory the graph engine's captures took"}}


def report(r: dict) -> str:
    if "skipped" in r:
        return f"cuda_graph_steps: skipped ({r['skipped']})"
    lines = [f"{r['model']} ({r['weights']}, {r['dtype']}), {r['bandwidth'] / 1e9:.0f} GB/s measured",
             r["summary"], f"{'N':>4} {'eager ms':>9} {'graphs ms':>10} {'speedup':>8}"]
    for t in r["steps"]["timings"]:
        lines.append(f"{t['size']:>4} {t['eager_ms']:>9.3f} {t['compiled_ms']:>10.3f} "
                     f"{t['eager_ms'] / t['compiled_ms']:>7.2f}x")
    for b, d in r["decode"].items():
        lines.append(f"{b}: eager {d['eager_ms_per_step']:.3f}, graphs {d['graphs_ms_per_step']:.3f} "
                     f"ms/step ({d['graphs_over_eager']:.2f}x); floor {d['floor_ms_per_step']:.3f} ms "
                     f"(eager {d['eager_over_floor']:.1f}x it, graphs {d['graphs_over_floor']:.1f}x)")
    return "\n".join(lines)
