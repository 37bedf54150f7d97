"""KV-cache arithmetic against hand-computed values and against real allocations."""
import math

import pytest
import torch

from minillm import KVCache, get_config, tiny_model
from minillm.analysis.kv_math import (attention_variants, kv_bytes_per_token, kv_cache_bytes,
                             plan_capacity, reservation_waste, sample_output_lengths,
                             activation_reserve_bytes, seed_max_batch_tokens,
                             weight_bytes)
from minillm.paging.paged_cache import PagedKVCache
from minillm.analysis.roofline import get_hardware

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize("name, dtype, want", [
    ("llama-2-70b", "bf16", 2 * 80 * 8 * 128 * 2),     # 327,680 B: GQA, 8 KV heads
    ("llama-2-7b", "fp16", 2 * 32 * 32 * 128 * 2),     # 524,288 B: MHA
    ("llama-3-8b", "bf16", 2 * 32 * 8 * 128 * 2),      # 131,072 B
    ("mistral-7b", "fp8", 2 * 32 * 8 * 128 * 1),       # 65,536 B
    ("smollm2-135m", "fp32", 2 * 30 * 3 * 64 * 4),     # 46,080 B
])
def test_kv_bytes_per_token_by_hand(name, dtype, want):
    assert kv_bytes_per_token(get_config(name), dtype) == want


def test_llama2_70b_2048_tokens_fact_check():
    cfg = get_config("llama-2-70b")
    # article: "2 x L x d x n x b" = 2 * 80 * 8192 * 2048 * 2 and calls it ~512 MB.
    article_formula = 2 * 80 * 8192 * 2048 * 2
    assert article_formula == 5 * GiB                     # its own formula gives 5 GiB, not 512 MB
    assert kv_cache_bytes(attention_variants(cfg)["MHA"], 2048) == 5 * GiB
    assert kv_cache_bytes(cfg, 2048) == 640 * MiB         # real model: GQA with 8 KV heads
    assert kv_cache_bytes(attention_variants(cfg)["MQA"], 2048) == 80 * MiB
    # "100 concurrent requests -> 50 GB": 100 x 640 MiB = 62.5 GiB
    assert kv_cache_bytes(cfg, 2048, batch_size=100) == 62.5 * GiB


def test_weight_bytes_fact_checks():
    assert weight_bytes(get_config("llama-3-8b"), "bf16") == 8_030_261_248 * 2   # 16.06 GB
    w70 = weight_bytes(get_config("llama-2-70b"), "int4")
    assert w70 == get_config("llama-2-70b").num_params / 2                      # ~34.5 GB
    assert 34e9 < w70 < 35e9
    model = tiny_model()
    real = sum(p.numel() for p in model.parameters()) * 4
    assert weight_bytes(model.config, torch.float32) == real


@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 17), (2, 512)])
def test_formula_matches_real_kvcache(batch, seq):
    cfg = get_config("smollm2-135m")
    for dtype in (torch.float32, torch.bfloat16):
        assert KVCache(cfg, batch, seq, dtype=dtype).nbytes == kv_cache_bytes(cfg, seq, batch,
                                                                              dtype)


def test_planner_by_hand():
    # Llama-3-8B bf16 with 80e9 bytes at 0.9: 72e9 - 16,060,522,496 = 55,939,477,504 bytes of KV
    # budget; a block of 16 tokens = 16 * 131,072 = 2 MiB -> 26,674 blocks; 8192 tokens = 512
    # blocks per sequence -> 52 full-length sequences
    p = plan_capacity(get_config("llama-3-8b"), 80e9, 0.9, 16, 8192)
    assert p.kv_budget_bytes == 72e9 - 16_060_522_496
    assert p.bytes_per_block == 2 * MiB
    assert p.num_blocks == 55_939_477_504 // (2 * MiB) == 26_674
    assert p.num_tokens == 26_674 * 16
    assert p.blocks_per_seq == 512 and p.max_num_seqs == 52
    # the H100 preset is the card's real 80 GiB: 0.9 * 85,899,345,920 - weights = 61,248,888,832
    h = plan_capacity(get_config("llama-3-8b"), get_hardware("h100-sxm"), 0.9, 16, 8192)
    assert h.memory_bytes == 80 * 2**30 and h.num_blocks == 61_248_888_832 // (2 * MiB) == 29_205
    assert h.max_num_seqs == 57


def test_activation_reserve_by_hand():
    cfg = get_config("llama-3-8b")
    # MLP half is the wider one: 3 * 14336 = 43008 > qkv + out = (32 + 16) * 128 + 32 * 128 = 10240
    want = 8192 * (2 * 4096 + 43008) * 2 + 256 * 128256 * 4
    assert activation_reserve_bytes(cfg, 8192, "bf16", logits_rows=256) == want == 970_194_944
    # a model whose attention half is wider than its MLP: the max picks attention
    wide = cfg.with_(d_ff=1024)
    assert activation_reserve_bytes(wide, 10, "fp32") == 10 * (2 * 4096 + 10240) * 4 + 10 * 128256 * 4
    with pytest.raises(ValueError, match="num_tokens"):
        activation_reserve_bytes(cfg, 0)
    with pytest.raises(ValueError, match="logits_rows"):
        activation_reserve_bytes(cfg, 8, logits_rows=0)


def test_seed_001_rule_as_written():
    cfg = get_config("llama-3-8b")
    got = seed_max_batch_tokens(cfg, 80 * 2**30)
    assert got == pytest.approx(80 * 2**30 / (cfg.num_params * 2 + 131_072))
    assert 5 < got < 6                                         # "tokens": a dimensionless handful
    with pytest.raises(ValueError, match="memory_bytes"):
        seed_max_batch_tokens(cfg, 0)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_planner_matches_actual_allocation(block_size):
    cfg = tiny_model().config
    weights = weight_bytes(cfg, "fp32")
    memory = weights + 3_000_000
    plan = plan_capacity(cfg, memory, 1.0, block_size, 64, "fp32", activation_bytes=100_000)
    pool = PagedKVCache(cfg, plan.num_blocks, block_size, dtype=torch.float32)
    assert PagedKVCache.bytes_per_block(cfg, block_size) == plan.bytes_per_block
    assert pool.nbytes <= plan.kv_budget_bytes < pool.nbytes + plan.bytes_per_block
    assert plan.max_num_seqs == plan.num_blocks // math.ceil(64 / block_size)


def test_planner_monotone():
    cfg, mem = get_config("llama-3-8b"), 80e9
    blocks = [plan_capacity(cfg, mem, u).num_blocks for u in (0.5, 0.7, 0.9, 1.0)]
    assert blocks == sorted(blocks)
    seqs = [plan_capacity(cfg, mem, 0.9, max_model_len=s).max_num_seqs for s in (512, 2048, 8192)]
    assert seqs == sorted(seqs, reverse=True)
    toks = [plan_capacity(cfg, mem, 0.9, block_size=p).num_tokens for p in (1, 16, 256)]
    assert toks == sorted(toks, reverse=True)  # bigger blocks only lose the partial last block
    fp8 = plan_capacity(cfg, mem, 0.9, kv_dtype="fp8").num_tokens
    assert fp8 >= 2 * plan_capacity(cfg, mem, 0.9).num_tokens - 16


def test_kv_monotone_in_heads_tokens_batch():
    cfg = get_config("llama-2-70b")
    v = attention_variants(cfg)
    assert kv_cache_bytes(v["MQA"], 100) < kv_cache_bytes(v["GQA"], 100) < kv_cache_bytes(
        v["MHA"], 100)
    assert kv_cache_bytes(v["MHA"], 100) == 8 * kv_cache_bytes(v["GQA"], 100)  # n_rep = 8
    assert [kv_cache_bytes(cfg, s, 2) for s in (0, 1, 10)] == [0, 2 * 327_680, 20 * 327_680]


def test_reservation_waste_by_hand():
    # lengths 1, 16, 17 with max 32: static reserves 3 * 32 = 96 slots for 34 used;
    # blocks of 16 reserve 16 + 16 + 32 = 64; blocks of 1 reserve exactly 34
    r = {x.scheme: x for x in reservation_waste([1, 16, 17], 32, (1, 16, 32))}
    assert (r["static"].used_tokens, r["static"].reserved_tokens) == (34, 96)
    assert r["block 16"].reserved_tokens == 64 and r["block 16"].waste == 1 - 34 / 64
    assert r["block 1"].waste == 0.0
    assert r["block 32"].reserved_tokens == 32 + 32 + 32


def test_reservation_waste_heavy_tail():
    lengths = sample_output_lengths(2000, max_len=2048, seed=0)
    assert lengths == sample_output_lengths(2000, max_len=2048, seed=0)  # seeded
    assert min(lengths) >= 1 and max(lengths) <= 2048
    assert sum(lengths) / len(lengths) > sorted(lengths)[1000]          # mean > median: long tail
    res = reservation_waste(lengths, 2048)
    wastes = [x.waste for x in res[1:]]                                 # P = 1, 2, ..., 256
    assert wastes == sorted(wastes)                                      # nested powers of 2
    # blocks waste at most P - 1 slots per sequence
    for x, p in zip(res[1:], (1, 2, 4, 8, 16, 32, 64, 128, 256)):
        assert x.reserved_tokens - x.used_tokens <= (p - 1) * len(lengths)
    assert res[0].waste > 0.75                                           # static: most is waste


def test_lognormal_lengths_follow_their_law():
    """Against the law itself: log(length) ~ Normal(log median, sigma) before rounding up, so the
    sample median and the log-space spread match, and P(length <= m) = Phi((log m - mu) / sigma)."""
    from minillm.analysis.kv_math import lognormal_lengths
    n, median, sigma = 40_000, 100.0, 0.8
    x = torch.tensor(lognormal_lengths(n, median, sigma, seed=1), dtype=torch.float64)
    assert abs(x.median().item() / median - 1) < 0.03
    assert abs((x - 0.5).log().std().item() / sigma - 1) < 0.03        # ceil adds ~0.5 on average
    for m in (30, 100, 400):
        phi = 0.5 * (1 + math.erf((math.log(m) - math.log(median)) / (sigma * 2 ** 0.5)))
        assert abs((x <= m).double().mean().item() - phi) < 0.01        # ceil: length <= m iff draw <= m
    capped = lognormal_lengths(n, median, sigma, high=150, seed=1)
    assert capped == [min(int(v), 150) for v in x.tolist()]              # same stream, clipped


@pytest.mark.parametrize("call, match", [
    (lambda: plan_capacity(get_config("llama-2-70b"), get_hardware("a100-80gb-sxm")),
     "leave no KV memory"),
    (lambda: plan_capacity(get_config("llama-3-8b"), 80e9, 1.5), "gpu_memory_utilization"),
    (lambda: plan_capacity(get_config("llama-3-8b"), 80e9, 0.9, 0), "block_size"),
    (lambda: plan_capacity(get_config("llama-3-8b"), -1), "memory"),
    (lambda: kv_bytes_per_token(get_config("llama-3-8b"), "fp13"), "unknown dtype"),
    (lambda: kv_cache_bytes(get_config("llama-3-8b"), -5), "num_tokens"),
    (lambda: reservation_waste([10, 40], 32), "exceeds max_len"),
    (lambda: reservation_waste([], 32), "non-empty"),
    (lambda: sample_output_lengths(0), "n must be"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
    with pytest.raises(TypeError, match="ModelConfig"):
        kv_bytes_per_token("llama")


def test_kv_crossover_by_hand():
    from minillm.analysis.kv_math import kv_crossover_tokens
    from minillm.model.config import get_config
    cfg = get_config("smollm2-135m")
    per_token = 2 * 30 * 3 * 64 * 4                       # K and V, 30 layers, 3 kv heads, fp32
    assert kv_crossover_tokens(cfg, 1, "fp32", "fp32") == pytest.approx(cfg.num_params * 4 / per_token)
    assert kv_crossover_tokens(cfg, 8, "fp32", "fp32") == pytest.approx(cfg.num_params * 4 / per_token / 8)
    assert kv_crossover_tokens(cfg, 1, "int8", "fp32") == pytest.approx(4 * kv_crossover_tokens(cfg, 1, "fp32", "fp32"))
    with pytest.raises(ValueError, match="batch_size"):
        kv_crossover_tokens(cfg, 0)
