"""Roofline formulas against hand arithmetic and against FLOPs counted on the real modules."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from minillm import KVCache, get_config, tiny_model
from minillm.model.config import PRESETS
from minillm.analysis.roofline import (HARDWARE_PRESETS, Hardware, OpCost, decode_compute_bound_batch,
                              decode_costs, dtype_bytes, get_hardware, prefill_costs, step_costs,
                              step_time, total_cost)
from minillm.lab.measure import (decode_breakdown, decode_weight_bytes,
                                      measure_bandwidth, measure_decode_steps,
                                      measure_matmul_flops, time_matmul)


def by_name(costs):
    return {c.name: c for c in costs}


# ---------------------------------------------------------------- hardware and dtypes

def test_datasheet_ridges():
    # A100: 312 TFLOP/s bf16 dense / 2.039 TB/s = 153.0 FLOP/byte (the article's "~150")
    assert get_hardware("a100-80gb-sxm").ridge("bf16") == pytest.approx(312e12 / 2.039e12)
    assert get_hardware("A100-80GB-SXM").ridge(torch.bfloat16) == pytest.approx(153.0, abs=0.1)
    # H100 SXM: 989.4 / 3.35 = 295.3; H200: same compute, 4.8 TB/s -> 206.1
    assert get_hardware("h100-sxm").ridge("bf16") == pytest.approx(295.3, abs=0.1)
    assert get_hardware("h200").ridge("fp16") == pytest.approx(206.1, abs=0.1)
    assert get_hardware("h200").mem_bytes == 141 * 2**30       # NVIDIA's "141 GB" are GiB
    # fp32 without tensor cores: 19.5 TFLOP/s / 2.039 TB/s = 9.56
    assert get_hardware("a100-80gb-sxm").ridge("fp32") == pytest.approx(9.56, abs=0.01)


def test_attainable_is_min_of_roofs():
    hw = Hardware("toy", {"fp32": 100.0}, mem_bandwidth=10.0, mem_bytes=1.0)
    assert hw.ridge("fp32") == 10.0
    assert hw.attainable(2.0, "fp32") == 20.0    # memory-bound: 2 * 10
    assert hw.attainable(50.0, "fp32") == 100.0  # compute-bound: the peak
    # op time: 1000 FLOPs at 100/s = 10 s vs 30 bytes at 10 B/s = 3 s -> 10 s
    assert step_time([OpCost("x", 1000, 30)], hw, "fp32") == 10.0


def test_dtype_errors():
    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.float32) == 4
    assert dtype_bytes("int4") == 0.5 and dtype_bytes("BFloat16") == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("fp13")
    with pytest.raises(TypeError, match="dtype"):
        dtype_bytes(2)
    with pytest.raises(ValueError, match="no peak"):
        get_hardware("a100-80gb-sxm").peak("fp8")
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu-v9")
    with pytest.raises(ValueError, match="mem_bandwidth"):
        Hardware("bad", {"fp32": 1.0}, mem_bandwidth=0, mem_bytes=1)


# ---------------------------------------------------------------- FLOPs and bytes by hand

def test_llama2_7b_decode_by_hand():
    cfg = get_config("llama-2-7b")  # L=32, H=Hkv=32, D=128, d=4096, d_ff=11008, V=32000
    c = by_name(decode_costs(cfg, batch_size=1, context_len=1023, dtype="bf16"))
    # qkv: 2 * 1 token * 4096 * (32 + 64) * 128 = 100,663,296 FLOPs per layer, x 32 layers
    assert c["qkv_proj"].flops == 32 * 2 * 4096 * 12288
    # bytes: weights 4096 * 12288 * 2 + input 4096 * 2 + output 12288 * 2, per layer
    assert c["qkv_proj"].bytes == 32 * (4096 * 12288 * 2 + 4096 * 2 + 12288 * 2)
    # Q K^T over 1024 keys: 2 * 32 heads * 1024 * 128 per layer
    assert c["attn_scores"].flops == 32 * 2 * 32 * 1024 * 128
    # reads Q (32 * 128 * 2 bytes) and K (1024 keys * 32 heads * 128 * 2 bytes)
    assert c["attn_scores"].bytes == 32 * (32 * 128 * 2 + 1024 * 32 * 128 * 2)
    assert c["mlp_gate_up"].flops == 32 * 2 * 4096 * 22016
    assert c["mlp_down"].flops == 32 * 2 * 11008 * 4096
    assert c["lm_head"].flops == 2 * 4096 * 32000
    assert c["lm_head"].bytes == 4096 * 32000 * 2 + (4096 + 32000) * 2


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_decode_total_matches_param_count(name):
    # decode at B=1: every matmul weight is used once (2 FLOPs each); independent of the op list,
    # the matmul weights are all parameters minus norms (2L + 1 vectors of d) and, if untied,
    # the embedding table. Attention adds 2 * 2 * H * D * (S + 1) per layer.
    cfg, S = get_config(name), 100
    mm_params = cfg.num_params - (2 * cfg.n_layer + 1) * cfg.d_model \
        - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    attn = cfg.n_layer * 4 * cfg.n_head * cfg.head_dim * (S + 1)
    t = total_cost(decode_costs(cfg, 1, S, "bf16"))
    assert t.flops == 2 * mm_params + attn
    assert decode_weight_bytes(cfg, "bf16") == 2 * mm_params
    kv = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * (S + 1) * 2
    assert t.bytes > 2 * mm_params + kv  # plus activations
    assert t.bytes < 1.01 * (2 * mm_params + kv)


def test_70b_decode_intensity_is_about_one():
    # 2 FLOPs per weight and 2 bytes per bf16 weight -> intensity ~1 at batch 1 (article: "1-2")
    t = total_cost(decode_costs(get_config("llama-2-70b"), 1, 0, "bf16"))
    assert t.intensity == pytest.approx(1.0, abs=0.01)
    assert t.flops == pytest.approx(2 * 68.7e9, rel=0.01)


def test_8b_decode_step_at_3tbs():
    # 16.06 GB of bf16 weights, but the untied 128256 x 4096 embedding is only gathered, not
    # streamed: (8.03e9 - 0.525e9) * 2 bytes / 3e12 B/s = 5.0 ms per step (not "under 1 ms")
    hw = Hardware("3 TB/s", {"bf16": 989.4e12}, mem_bandwidth=3e12, mem_bytes=80e9)
    t = step_time(decode_costs(get_config("llama-3-8b"), 1, 0, "bf16"), hw, "bf16")
    assert t == pytest.approx((8.03e9 - 128256 * 4096) * 2 / 3e12, rel=0.01)
    assert 4.9e-3 < t < 5.1e-3


class MatmulAttention:
    """Reference attention with explicit matmuls (so FlopCounterMode sees them), own K/V store."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer_idx, q, k, v, positions):
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, H, S, D)
        T, S = q.shape[2], k.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])        # (B, H, T, S)
        mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
        return F.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v  # (B, H, T, D)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_flops_match_flop_counter(kv_heads):
    model = tiny_model(dtype=torch.float64, n_kv_head=kv_heads)
    cfg, B, T = model.config, 3, 7
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    cache = MatmulAttention()
    with FlopCounterMode(display=False) as fc:
        model(ids, torch.arange(T), cache)                               # prefill
    want = total_cost(prefill_costs(cfg, T, B, "fp64", logits_tokens=T)).flops
    assert fc.get_total_flops() == want
    with FlopCounterMode(display=False) as fc:
        model(ids[:, :1], torch.tensor([T]), cache)                      # decode with S = T
    assert fc.get_total_flops() == total_cost(decode_costs(cfg, B, T, "fp64")).flops


# ---------------------------------------------------------------- properties and errors

def test_monotone_in_batch_and_context():
    cfg, hw = get_config("llama-3-8b"), get_hardware("h100-sxm")
    prev_i = prev_t = 0.0
    for b in [1, 2, 8, 32, 128, 512]:
        t = total_cost(decode_costs(cfg, b, 512))
        assert t.intensity > prev_i
        assert step_time(decode_costs(cfg, b, 512), hw, "bf16") > prev_t
        prev_i, prev_t = t.intensity, step_time(decode_costs(cfg, b, 512), hw, "bf16")
    times = [step_time(decode_costs(cfg, 8, s), hw, "bf16") for s in [0, 100, 1000, 10000]]
    assert times == sorted(times)
    # at batch 1 weight reads dominate: 8x the batch costs far less than 8x the time
    assert step_time(decode_costs(cfg, 8, 0), hw, "bf16") < 1.1 * step_time(
        decode_costs(cfg, 1, 0), hw, "bf16")


def test_compute_bound_batch():
    cfg, hw = get_config("llama-2-70b"), get_hardware("a100-80gb-sxm")
    b = decode_compute_bound_batch(cfg, hw, 0, "bf16")
    # with no context the intensity is ~B FLOP/byte, so B* sits just above the ridge (153)
    assert 153 <= b <= 170
    assert total_cost(decode_costs(cfg, b, 0)).intensity >= hw.ridge("bf16")
    assert total_cost(decode_costs(cfg, b - 1, 0)).intensity < hw.ridge("bf16")
    # MHA with a long context: KV reads grow with B as fast as FLOPs; never compute-bound
    assert decode_compute_bound_batch(get_config("llama-2-7b"), hw, 4096, max_batch=4096) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0, new_tokens=1, context_len=0), "batch_size"),
    (dict(batch_size=1, new_tokens=0, context_len=0), "new_tokens"),
    (dict(batch_size=1, new_tokens=1, context_len=-1), "context_len"),
    (dict(batch_size=1.5, new_tokens=1, context_len=0), "batch_size"),
    (dict(batch_size=1, new_tokens=2, context_len=0, logits_tokens=3), "logits_tokens"),
    (dict(batch_size=1, new_tokens=1, context_len=0, dtype="fp13"), "dtype"),
])
def test_bad_step_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_costs(get_config("smollm2-135m"), **kwargs)
    with pytest.raises(TypeError, match="ModelConfig"):
        step_costs("llama", 1, 1, 0)


# ------------------------------------------------ measurement (smoke, no timing asserts)

@pytest.fixture
def fake_clock(monkeypatch):
    """time_fn that runs the timed function twice (a warmup and one repeat, as the real one
    does at least) and reports 0.25 s: the formulas around the clock become exact."""
    import minillm.lab.measure as rm
    calls = []

    def time_fn(fn, device="cpu", warmup=1, repeat=3):
        calls.append(fn())
        calls.append(fn())
        return 0.25
    monkeypatch.setattr(rm, "time_fn", time_fn)
    return calls


def test_measurements_divide_the_work_by_the_time(fake_clock):
    hw = Hardware("toy", {"fp32": 1e10}, mem_bandwidth=1e9, mem_bytes=1e9)
    assert measure_bandwidth("cpu", nbytes=1 << 20, repeats=1) == (1 << 20) / 0.25
    assert fake_clock[-1].item() == (1 << 20) // 4                # it summed the whole buffer
    assert measure_matmul_flops("cpu", "fp32", n=64, repeats=1) == 2 * 64**3 / 0.25
    assert tuple(fake_clock[-1].shape) == (64, 64)
    p = time_matmul(hw, 4, 32, 48, "fp32", "cpu", repeats=1, min_weight_bytes=1 << 14)
    assert p.flops == 2 * 4 * 32 * 48 and p.bytes == (32 * 48 + 4 * 32 + 4 * 48) * 4
    copies = math.ceil((1 << 14) / (32 * 48 * 4))                 # weight copies beat the caches
    assert p.seconds == pytest.approx(0.25 / copies)
    # the prediction is the roofline's own (no timing involved): bytes over bandwidth or FLOPs over peak
    assert p.predicted_s == pytest.approx(max(p.flops / 1e10, p.bytes / 1e9))


def test_decode_steps_and_breakdown(fake_clock):
    model = tiny_model()
    times = measure_decode_steps(model, (1, 2), context_len=5, repeats=1, progress=False)
    # one timing per batch size; each timed step ran twice on a cache with room for one more
    # token, so the step rolls its cache back (else the second run would overflow it)
    assert times == [0.25, 0.25] and len(fake_clock) == 4
    cfg = model.config
    hw = Hardware("toy", {"fp32": 1e10}, mem_bandwidth=1e9, mem_bytes=1e9)
    parts = decode_breakdown(cfg, hw, 2, 5, measured_s=1.0)
    # weight bytes from the real modules: every Linear weight (lm_head untied here)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert parts["weights_s"] == pytest.approx(linear * 4 / 1e9)
    # KV read: the cache tensors of 2 rows x 6 tokens are what a real KVCache holds
    assert parts["kv_s"] == pytest.approx(KVCache(cfg, 2, 6).nbytes / 1e9)
    with pytest.raises(ValueError, match="measured_s"):
        decode_breakdown(cfg, hw, 1, 1, measured_s=0)


@pytest.mark.parametrize("name, bf16_tflops, tb_per_s, gb", [
    ("a100-80gb-sxm", 312, 2.039, 80), ("h100-sxm", 989.4, 3.35, 80), ("h200", 989.4, 4.8, 141)])
def test_presets_match_the_datasheets(name, bf16_tflops, tb_per_s, gb):
    """Dense (no sparsity) bf16 peak, HBM bandwidth and capacity from NVIDIA's datasheets (their
    "GB" of HBM are GiB: torch reports about 79 GiB usable on an 80 GB H100)."""
    hw = HARDWARE_PRESETS[name]
    assert hw.peak("bf16") == pytest.approx(bf16_tflops * 1e12)
    assert hw.mem_bandwidth == pytest.approx(tb_per_s * 1e12) and hw.mem_bytes == gb * 2**30
    flops = hw.peak_flops
    assert flops["fp64"] <= flops["fp32"] < flops["tf32"] < flops["bf16"] == flops["fp16"]
    assert flops["int8"] == pytest.approx(2 * flops["bf16"], rel=1e-3)


def test_widget_views_are_static_figures():
    import matplotlib
    matplotlib.use("Agg")
    from minillm.viz.widgets import kv_view, roofline_view
    fig, text = roofline_view(get_hardware("a100-80gb-sxm"), "llama-2-70b", "bf16", 1, 0)
    assert fig.axes and "intensity 1.00 FLOP/byte" in text and "from B = 158" in text
    fig, text = kv_view("llama-2-70b", "fp16", 2048, 1, kv_heads=8)
    assert "327,680 B/token" in text and "KV 0.62 GiB" in text


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 9), S=st.integers(0, 12),
       heads=st.sampled_from([(4, 1), (4, 4), (6, 2)]))
def test_flops_match_flop_counter_random_shapes(B, T, S, heads):
    # a chunk of T tokens after S cached ones (chunked prefill / speculative verification shape)
    model = tiny_model(dtype=torch.float64, n_head=heads[0], n_kv_head=heads[1])
    cfg, cache = model.config, MatmulAttention()
    ids = torch.randint(0, cfg.vocab_size, (B, S + T), generator=torch.Generator().manual_seed(1))
    if S:
        model(ids[:, :S], torch.arange(S), cache)
    with FlopCounterMode(display=False) as fc:
        model(ids[:, S:], positions=torch.arange(S, S + T), cache=cache)
    want = total_cost(step_costs(cfg, B, T, S, "fp64", logits_tokens=T)).flops
    assert fc.get_total_flops() == want


def test_breakdown_splits_overhead_into_matmuls_below_roof_and_the_rest():
    from minillm.lab.measure import decode_breakdown
    cfg = get_config("smollm2-135m")
    hw = Hardware("toy", {"fp32": 1e12}, mem_bandwidth=10e9, mem_bytes=1e9)
    base = decode_breakdown(cfg, hw, 1, 64, measured_s=0.1)
    assert "matmul_below_roof_s" not in base                  # the old keys only, unchanged
    weights = base["weights_s"]                                # 538 MB at 10 GB/s: about 54 ms
    parts = decode_breakdown(cfg, hw, 1, 64, measured_s=0.1, matmul_s=weights + 0.03)
    assert parts["matmul_below_roof_s"] == pytest.approx(0.03)
    assert parts["other_s"] == pytest.approx(base["overhead_s"] - 0.03)
    # matmuls faster than the buffer read: nothing below the roof, the whole rest is "other"
    fast = decode_breakdown(cfg, hw, 1, 64, measured_s=0.1, matmul_s=weights / 2)
    assert fast["matmul_below_roof_s"] == 0 and fast["other_s"] == pytest.approx(base["overhead_s"])
    with pytest.raises(ValueError, match="matmul_s"):
        decode_breakdown(cfg, hw, 1, 64, measured_s=0.1, matmul_s=0)


class _WeightMatmuls(TorchDispatchMode):
    """Logs (op, weight, argument shapes as (rows, last dim)) of every ATen op that reads one of
    `weights` (or a view of one)."""

    def __init__(self, weights):
        super().__init__()
        self.names, self.calls = {w.data_ptr(): n for n, w in weights}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        hit = [self.names[t.data_ptr()] for t in tensors if t.data_ptr() in self.names]
        if hit:
            self.calls.append((func.overloadpacket.__name__, hit[0], 
                               [(t.numel() // t.shape[-1], t.shape[-1]) for t in tensors if t.dim()]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("route", [None, "F.linear", "ksplit", "nsplit", "x@W"])
def test_decode_matmuls_are_the_matmuls_of_a_real_decode_step(route):
    """The matmuls `decode_matmuls` times are those one decode step of the model runs: the same
    ATen ops on the same weights with the same shapes, in the same order, at batch 1 and 3; the
    reference forward (route None: plain nn.Linear) and the flat loop under each pinned route."""
    from minillm.lab import measure
    from minillm.kernels.cpu_tuning import accelerate
    from minillm.model.kv_cache import KVCache
    from minillm.model.loading import tiny_model
    model = tiny_model(n_layer=2)
    if route is not None:
        accelerate(model, route=route)
    weights = [(n, p) for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    for B in (1, 3):
        cache = KVCache(model.config, B, 16)
        with torch.inference_mode():
            model(torch.ones(B, 4, dtype=torch.long), torch.arange(4), cache)   # prefill, not logged
            with _WeightMatmuls(weights) as step:
                model(torch.ones(B, 1, dtype=torch.long), torch.tensor([4]), cache)  # one decode step
            with _WeightMatmuls(weights) as alone:
                measure.decode_matmuls(model, B)()
        assert len(step.calls) >= len(weights) and alone.calls == step.calls, (alone.calls, step.calls)


def test_measure_decode_matmuls_times_one_step_per_batch(monkeypatch):
    from minillm.lab import measure
    from minillm.model.loading import tiny_model
    model = tiny_model(n_layer=2)
    monkeypatch.setattr(measure, "time_fn", lambda fn, device, repeat: (fn(), 0.5)[1])
    assert measure.measure_decode_matmuls(model, (3, 1)) == [0.5, 0.5]
    with pytest.raises(ValueError, match="batch_sizes"):
        measure.measure_decode_matmuls(model, (0,))
    with pytest.raises(ValueError, match="batch"):
        measure.decode_matmuls(model, 0)
    with pytest.raises(ValueError, match="nn.Linear"):
        measure.decode_matmuls(torch.nn.Sequential(torch.nn.ReLU()), 1)


# ---------------------------------------------------------------- chapter 5: the ridge chunk

@pytest.mark.parametrize("model_name,hw_name,dtype,ctx", [
    ("smollm2-135m", "h100-sxm", "bf16", 0), ("llama-3-8b", "h100-sxm", "bf16", 0),
    ("llama-3-8b", "a100-80gb-sxm", "bf16", 512), ("smollm2-135m", "cpu", "fp32", 0)])
def test_chunk_compute_bound_tokens_is_the_first_chunk_past_the_ridge(model_name, hw_name, dtype, ctx):
    from minillm.analysis.roofline import chunk_compute_bound_tokens
    cfg = get_config(model_name)
    hw = (Hardware("a 2-core CPU", {"fp32": 2e10}, 4.4e9, 16e9) if hw_name == "cpu"
          else get_hardware(hw_name))
    t = 1                                            # linear scan, against the bisection
    while total_cost(step_costs(cfg, 1, t, ctx, dtype)).intensity < hw.ridge(dtype):
        t += 1
    assert chunk_compute_bound_tokens(cfg, hw, dtype, context_len=ctx) == t
    # fp32 weights-only estimate: 2 FLOP per 4-byte weight per token -> T ~ 2 x ridge (~9 here)
    if hw_name == "cpu":
        assert 2 * hw.ridge(dtype) <= t <= 4 * hw.ridge(dtype)


def test_chunk_compute_bound_tokens_none_and_bad_input():
    from minillm.analysis.roofline import chunk_compute_bound_tokens
    cfg, hw = get_config("smollm2-135m"), get_hardware("h100-sxm")
    assert chunk_compute_bound_tokens(cfg, hw, "bf16", max_tokens=8) is None
    with pytest.raises(ValueError, match="context_len"):
        chunk_compute_bound_tokens(cfg, hw, "bf16", context_len=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_compute_bound_tokens(cfg, hw, "bf16", max_tokens=0)


def test_bandwidth_buffer_outgrows_the_last_level_cache(monkeypatch):
    import minillm.lab.measure as rm
    monkeypatch.setattr(rm, "last_level_cache_bytes", lambda: 300 * 2**20)     # a 300 MiB L3
    ram = rm._memory_bytes(torch.device("cpu"))
    assert rm.bandwidth_buffer_bytes() == max(256 * 2**20, min(1200 * 2**20, int(ram) // 8))
    monkeypatch.setattr(rm, "last_level_cache_bytes", lambda: None)            # unknown: 256 MiB
    assert rm.bandwidth_buffer_bytes() == 256 * 2**20
