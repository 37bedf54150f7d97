"""FlashAttention's tiled forward (minillm/attention/tiled.py) against the materialized reference,
and the reference against SDPA and against attention written out with Python floats."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import minillm
from minillm.attention import (attention_reference, flash_attention, flash_attention_stats,
                               online_softmax_step)

F64 = torch.float64


def qkv(B, H, Hkv, T, S, D=8, dtype=F64, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=F64) * spread     # spread: the max moves between tiles
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=F64) * spread
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def python_attention(q, k, v, causal):
    """Attention with Python floats and math.exp, one query row at a time: (B, H, T, D) lists."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q, k, v = q.tolist(), k.tolist(), v.tolist()
    out = [[[[0.0] * D for _ in range(T)] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hkv)
            for t in range(T):
                keys = [j for j in range(S) if not causal or j <= S - T + t]
                s = [sum(q[b][h][t][i] * k[b][kh][j][i] for i in range(D)) / math.sqrt(D) for j in keys]
                w = [math.exp(x - max(s)) for x in s]
                for i in range(D):
                    out[b][h][t][i] = sum(wj * v[b][kh][j][i] for wj, j in zip(w, keys)) / sum(w)
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_against_python_math_and_sdpa(causal):
    q, k, v = qkv(2, 6, 2, 5, 9, D=4)
    ref = attention_reference(q, k, v, causal=causal)
    torch.testing.assert_close(ref, python_attention(q, k, v, causal), rtol=0, atol=1e-12)
    q, k, v = qkv(2, 9, 3, 37, 70)
    allowed = torch.arange(70) <= (70 - 37 + torch.arange(37))[:, None]
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                          attn_mask=allowed if causal else None)
    torch.testing.assert_close(attention_reference(q, k, v, causal=causal), sdpa, rtol=0, atol=1e-12)


PAIRS = [(t, s) for t in (1, 7, 63, 65, 130) for s in (1, 7, 63, 65, 130) if s >= t]


@pytest.mark.parametrize("T,S", PAIRS)
@pytest.mark.parametrize("causal", [True, False])
def test_float64_equal_to_reference_on_odd_lengths_and_block_sizes(T, S, causal):
    q, k, v = qkv(1, 9, 3, T, S, seed=T * 1000 + S)
    ref = attention_reference(q, k, v, causal=causal)
    blocks = [(16, 16), (64, 64), (S + 5, S + 5), (1, 16), (16, 1)] + ([(1, 1)] if S <= 65 else [])
    for bq, bk in blocks:
        out = flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=f"block_q={bq} block_k={bk}")


@pytest.mark.parametrize("H,Hkv", [(9, 3), (4, 4), (6, 1)])
def test_gqa_mha_mqa_and_batch(H, Hkv):
    q, k, v = qkv(3, H, Hkv, 20, 33, seed=H)
    out = flash_attention(q, k, v, block_q=8, block_k=8)
    torch.testing.assert_close(out, attention_reference(q, k, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1:2], flash_attention(q[1:2], k[1:2], v[1:2], block_q=8, block_k=8),
                               rtol=0, atol=1e-12)


def test_scores_increasing_along_the_keys_need_the_rescale():
    """Each key tile raises the row maximum: a partial output that is not rescaled by
    exp(m_old - m_new) is far off here (the planted bug this test is built to catch)."""
    D, S = 4, 64
    q = torch.ones(1, 1, 1, D, dtype=F64)
    k = torch.linspace(0, 8, S, dtype=F64).view(1, 1, S, 1).expand(1, 1, S, D).contiguous()
    v = torch.randn(1, 1, S, D, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = flash_attention(q, k, v, causal=False, block_k=8)
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=False), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_fp32_and_bf16_within_tolerance(dtype, atol):
    """Against the float64 reference on the same (rounded) inputs. fp32: rounding of sums over 200
    keys (measured ~4e-7). bf16: accumulated in fp32, so the error is the output's rounding to bf16
    (8 bits of mantissa: an ulp is 2^-7 for |out| in [1, 2), half an ulp ~4e-3); dense attention in
    bf16 rounds the scores and probabilities too and is worse (~8e-3 measured)."""
    q, k, v = qkv(2, 9, 3, 100, 200, D=16, dtype=dtype, spread=1.0)
    ref = attention_reference(q.double(), k.double(), v.double())
    out = flash_attention(q, k, v, block_q=32, block_k=32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)
    dense_err = (attention_reference(q, k, v).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= dense_err + atol / 2      # no worse than dense attention


def test_ragged_batch_by_key_padding_equals_each_sequence_alone():
    """Contexts of 5, 40 and 70 keys, left-padded to 70 (the queries stay the last T positions),
    causal, T = 4; and right-padded, not causal."""
    lens, S, T = [5, 40, 70], 70, 4
    q, k, v = qkv(3, 9, 3, T, S, seed=4)
    pad = torch.arange(S)[None, :] >= (S - torch.tensor(lens))[:, None]      # (B, S) True = a real key
    out = flash_attention(q, k, v, mask=pad[:, None, None, :], block_q=3, block_k=16)
    for b, n in enumerate(lens):
        alone = attention_reference(q[b:b + 1], k[b:b + 1, :, S - n:], v[b:b + 1, :, S - n:])
        torch.testing.assert_close(out[b:b + 1], alone, rtol=0, atol=1e-12)
    right = torch.arange(S)[None, :] < torch.tensor(lens)[:, None]
    out = flash_attention(q, k, v, causal=False, mask=right[:, None, None, :], block_q=3, block_k=16)
    for b, n in enumerate(lens):
        alone = attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=False)
        torch.testing.assert_close(out[b:b + 1], alone, rtol=0, atol=1e-12)


def test_a_query_that_sees_no_key_gets_zero_never_nan():
    q, k, v = qkv(2, 9, 3, 6, 30)
    mask = torch.ones(2, 9, 6, 30, dtype=torch.bool)
    mask[0, 4, 2] = False                       # one row hides every key
    mask[1] = False                             # a whole sequence of padding
    for dtype in (F64, torch.float32, torch.bfloat16):
        out, lse = flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, block_k=7,
                                   return_lse=True)
        ref = attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask)
        assert not out.isnan().any() and not ref.isnan().any()
        assert (out[0, 4, 2] == 0).all() and (out[1] == 0).all() and (ref[1] == 0).all()
        assert (lse[0, 4, 2] == float("-inf")) and (lse[1] == float("-inf")).all()
        assert out[0, 4, 1].abs().sum() > 0


def test_lse_is_the_logsumexp_of_the_visible_scaled_scores():
    q, k, v = qkv(2, 9, 3, 13, 29)
    _, lse = flash_attention(q, k, v, block_q=4, block_k=5, return_lse=True)
    scores = q @ k.repeat_interleave(3, 1).transpose(-2, -1) / math.sqrt(8)
    allowed = torch.arange(29) <= (29 - 13 + torch.arange(13))[:, None]
    want = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(lse, want, rtol=0, atol=1e-12)


def test_scale_argument():
    q, k, v = qkv(1, 3, 3, 9, 9)
    out = flash_attention(q, k, v, scale=0.7, block_q=4, block_k=4)
    torch.testing.assert_close(out, attention_reference(q * (0.7 * math.sqrt(8)), k, v), rtol=0, atol=1e-12)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ in ("bmm", "mm")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_causal_skips_the_tiles_above_the_diagonal(n):
    """T = S = n tiles of 16: n(n+1)/2 tiles computed, n of them masked, n(n-1)/2 skipped; the loop
    really runs two matmuls (q k^T, p v) per computed tile and no more."""
    stats = flash_attention_stats(16 * n, 16 * n, block_q=16, block_k=16)
    assert (stats.total, stats.visited, stats.masked, stats.skipped) == (n * n, n * (n + 1) // 2, n,
                                                                          n * (n - 1) // 2)
    q, k, v = qkv(1, 9, 3, 16 * n, 16 * n)
    with CountMatmuls() as count:
        flash_attention(q, k, v, block_q=16, block_k=16)
    assert count.n == 2 * stats.visited
    assert flash_attention_stats(16 * n, 16 * n, causal=False, block_q=16, block_k=16).skipped == 0


def test_skipped_tiles_when_the_queries_are_the_last_of_the_context():
    # T = 32 queries at positions 96..127 of S = 128, tiles of 32: every key tile visible, the last masked
    assert flash_attention_stats(32, 128, block_q=32, block_k=32) == minillm.attention.TileStats(4, 4, 0, 1)
    # T = 64 at 64..127: query tile 0 (64..95) sees key tiles 0..2, tile 1 sees all four
    assert flash_attention_stats(64, 128, block_q=32, block_k=32) == minillm.attention.TileStats(8, 7, 1, 2)


def test_online_softmax_identity_two_halves_merge_to_the_whole():
    g = torch.Generator().manual_seed(5)
    s, v = torch.randn(3, 10, dtype=F64, generator=g) * 4, torch.randn(10, 2, dtype=F64, generator=g)
    m, l, acc = torch.full((3, 1), float("-inf"), dtype=F64), torch.zeros(3, 1, dtype=F64), torch.zeros(3, 2, dtype=F64)
    for lo, hi in ((0, 4), (4, 10)):
        m, l, acc = online_softmax_step(m, l, acc, s[:, lo:hi], v[lo:hi])
    assert torch.equal(m, s.max(-1, keepdim=True).values)
    torch.testing.assert_close(l, torch.exp(s - m).sum(-1, keepdim=True), rtol=1e-15, atol=0)
    torch.testing.assert_close(acc / l, torch.softmax(s, -1) @ v, rtol=0, atol=1e-14)


def test_exported_from_minillm():
    assert minillm.flash_attention is flash_attention


BAD = [
    (dict(block_q=0), ValueError, "block_q must be an int >= 1"),
    (dict(block_k=-3), ValueError, "block_k must be an int >= 1"),
    (dict(block_q=16.0), TypeError, "block_q must be an int"),
    (dict(block_k=True), TypeError, "block_k must be an int"),
    (dict(block_k=2.5), TypeError, "block_k must be an int >= 1, got float 2.5"),
    (dict(scale=0.0), ValueError, "scale must be a real number > 0"),
    (dict(mask=torch.ones(2, 9, 5, 11, dtype=torch.bool)), ValueError, r"mask must be broadcastable to \(B, H, T, S\)"),
    (dict(mask=torch.ones(1, 1, 1, 1, 11, dtype=torch.bool)), ValueError, "mask must be broadcastable"),
    (dict(mask=torch.ones(5, 12)), TypeError, "mask must be a bool tensor"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD)
def test_bad_arguments(kwargs, exc, match):
    q, k, v = qkv(1, 9, 3, 5, 12)
    for fn in (flash_attention, attention_reference):
        if "block" in "".join(kwargs) and fn is attention_reference:
            continue
        with pytest.raises(exc, match=match):
            fn(q, k, v, **kwargs)


@pytest.mark.parametrize("shapes,match", [
    (((1, 9, 5, 8), (1, 4, 12, 8), (1, 4, 12, 8)), "head count Hkv must divide q's head count H = 9"),
    (((1, 9, 5, 8), (1, 3, 12, 4), (1, 3, 12, 4)), r"head dim must equal q's \(D = 8\)"),
    (((2, 9, 5, 8), (1, 3, 12, 8), (1, 3, 12, 8)), r"batch size must equal q's \(B = 2\)"),
    (((1, 9, 5, 8), (1, 3, 4, 8), (1, 3, 4, 8)), "length S must be >= q's length T = 5"),
    (((1, 9, 5, 8), (1, 3, 12, 8), (1, 3, 11, 8)), "k and v must have the same shape"),
    (((9, 5, 8), (1, 3, 12, 8), (1, 3, 12, 8)), r"q must be a 4-D tensor \(B, H, T, D\)"),
])
def test_bad_shapes(shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    for fn in (flash_attention, attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v)


def test_bad_dtypes():
    q, k, v = qkv(1, 9, 3, 5, 12)
    with pytest.raises(TypeError, match="share one floating dtype"):
        flash_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attention(q, k.tolist(), v)
    with pytest.raises(ValueError, match="S must be an int >= 7"):
        flash_attention_stats(7, 6)
