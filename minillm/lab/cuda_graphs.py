"""Decode launch overhead and CUDA graphs, in pure PyTorch (chapter 1, GPU-only section).

A batch-1 decode step of a 135M model launches a few hundred small kernels (30 layers x norms,
matmuls, RoPE, attention, SwiGLU). On an H200 each kernel finishes in microseconds, so the step
time is set by the CPU launching kernels, not by reading the 270 MB of bf16 weights (~0.06 ms at
4.8 TB/s). A CUDA graph records the whole step once and replays it with one launch.

A graph replays fixed kernels on fixed memory, so nothing in the step may depend on a Python
value that changes between steps. The contiguous `KVCache` reads the last position back to the
host to slice the filled slots, which a graph would freeze at capture time. `StaticKVCache`
(minillm.model.kv_cache) never does: new keys are written with `index_copy_` at the positions
and attention runs over all S_max slots with a mask (slot s is visible to a query at position p
when s <= p), so one captured graph is valid at any position.

Letters: B batch, T new tokens, S_max cache slots, H heads, Hkv kv heads, D head dim, V vocab.

The benchmark (`python -m benchmarks cuda_graphs`, and the GPU script) writes the record.
Left out on purpose: torch.compile, graphs for prefill or for several batch sizes (vLLM captures
one graph per batch size), paged caches in graphs, and attention that skips the masked slots.
"""
import torch

from minillm.model.kv_cache import KVCache, StaticKVCache


def forward_static(model, cache: StaticKVCache, input_ids: torch.Tensor, positions: torch.Tensor):
    """`model(input_ids)` with a StaticKVCache: input_ids (B, T), positions (T,) -> logits (B, T, V)."""
    return model(input_ids, positions, cache)


class GraphDecoder:
    """One captured batch-B decode step: `step(token_ids, position)` -> logits (B, V).

    The returned tensor is the graph's static output buffer: it is overwritten by the next step.
    """

    def __init__(self, model, cache: StaticKVCache, batch_size: int = 1, warmup: int = 3):
        device = model.device
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the model is on {device}")
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)   # (B, 1)
        # warm-up runs really execute: aim them at the last slot, which every real step at
        # an earlier position masks out and a step at that position overwrites before reading
        self.pos = torch.full((1,), cache.max_seq_len - 1, dtype=torch.long, device=device)  # (1,)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():   # warm up kernels, allocator
            for _ in range(warmup):
                forward_static(model, cache, self.ids, self.pos)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = forward_static(model, cache, self.ids, self.pos)[:, -1]   # (B, V)

    def step(self, token_ids: torch.Tensor, position) -> torch.Tensor:
        self.ids.copy_(token_ids.view(-1, 1))
        if isinstance(position, torch.Tensor):
            self.pos.copy_(position.view(1))
        else:
            self.pos.fill_(int(position))
        self.graph.replay()
        return self.logits


def _require_cuda(model) -> torch.device:
    if not torch.cuda.is_available() or model.device.type != "cuda":
        raise RuntimeError("measure_launch_overhead needs CUDA: a CUDA build of torch, a GPU, "
                           f"and the model on it (the model is on {model.device})")
    return model.device


def _time_loop(step, first: torch.Tensor, steps: int, device) -> float:
    """ms per step of a greedy loop that feeds each argmax back in (no host sync inside)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    token = first
    torch.cuda.synchronize(device)
    start.record()
    for i in range(steps):
        token = step(token, i).argmax(-1)                          # (B,)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / steps


@torch.inference_mode()
def measure_launch_overhead(model, steps: int = 64, prompt_len: int = 16, seed: int = 0) -> dict:
    """Batch-1 greedy decode, ms/step: eager with KVCache, eager with StaticKVCache, graph replay."""
    if not isinstance(steps, int) or not 1 <= steps <= 4096:
        raise ValueError(f"steps must be an int in [1, 4096], got {steps!r}")
    device = _require_cuda(model)
    cfg, S = model.config, prompt_len + 2 * steps
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(cfg.vocab_size, (1, prompt_len), generator=gen).to(device)  # (1, T)
    start_pos = torch.arange(prompt_len, device=device)

    static = StaticKVCache(cfg, 1, S, device=device, dtype=model.dtype)
    decoder = GraphDecoder(model, static)
    first = forward_static(model, static, prompt, start_pos)[:, -1].argmax(-1)          # (1,)
    pos = torch.zeros(1, dtype=torch.long, device=device)

    def eager_static(token, i):
        pos.fill_(prompt_len + i)
        return forward_static(model, static, token.view(1, 1), pos)[:, -1]

    dynamic = KVCache(cfg, 1, S, device=device, dtype=model.dtype)
    model(prompt, start_pos, dynamic)                              # same prompt, same first token
    eager_dynamic = lambda token, i: model(token.view(1, 1), torch.tensor([prompt_len + i], device=device),
                                           dynamic)[:, -1]

    graph = lambda token, i: decoder.step(token, prompt_len + i)
    results = {}
    loops = (("eager_kvcache", eager_dynamic), ("eager_static", eager_static), ("graph", graph))
    for name, fn in loops:                                # step i writes position prompt_len + i
        _time_loop(fn, first, min(steps, 8), device)                                   # warm-up
        results[name] = min(_time_loop(fn, first, steps, device) for _ in range(3))
    eager_logits = eager_static(first, 0).clone()
    graph_logits = graph(first, 0).clone()
    return {"model": cfg.name, "dtype": str(model.dtype).replace("torch.", ""), "batch_size": 1,
            "steps": steps, "prompt_len": prompt_len, "device_name": torch.cuda.get_device_name(device),
            "units": {"ms_per_step": "ms per decode step (CUDA events, best of 3 loops)"},
            "eager_ms_per_step": results["eager_kvcache"],
            "eager_static_ms_per_step": results["eager_static"],
            "graph_ms_per_step": results["graph"],
            "graph_speedup": results["eager_kvcache"] / results["graph"],
            "graph_max_abs_diff_vs_eager": (graph_logits - eager_logits).abs().max().item()}
