"""Chapter 9's exercise checks accept a right answer worked out here by hand and reject wrong ones."""
import math

import torch

from minillm import exercises


def test_09_1_tiles_by_hand():
    n = math.ceil(1300 / 64)                     # 21 tiles per side; query tile i needs key tiles 0..i
    assert exercises.check("09.1", n * (n + 1) // 2)
    assert not exercises.check("09.1", n * n)    # no skipping
    assert not exercises.check("09.1", n * n / 2)


def test_09_2_io_ratio_by_hand():
    N, d, M = 20480, 64, 2 ** 18
    standard = 4 * N * d + 4 * N * N             # Q, K, V read, O written; S, P written and read
    B_c = math.ceil(M / (4 * d))                 # 1024
    T_c = math.ceil(N / B_c)                     # 20 key tiles
    flash = 2 * N * d + T_c * N * (2 * d + 2 + d + 2)
    assert exercises.check("09.2", standard / flash)
    assert not exercises.check("09.2", N / 1)    # "reads drop from N^2 to N"
    assert not exercises.check("09.2", M / d ** 2)  # the asymptotic ratio without its constants


def good_step(m, l, acc, s, v):
    m_new = torch.maximum(m, s.max(-1, keepdim=True).values)
    base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(s - base)
    scale = torch.exp(m - base)
    return m_new, scale * l + p.sum(-1, keepdim=True), scale * acc + p @ v


def test_09_3_online_step():
    assert exercises.check("09.3", good_step)

    def no_rescale(m, l, acc, s, v):
        m_new = torch.maximum(m, s.max(-1, keepdim=True).values)
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - base)
        return m_new, l + p.sum(-1, keepdim=True), acc + p @ v
    assert not exercises.check("09.3", no_rescale)

    def nan_on_empty_rows(m, l, acc, s, v):     # the textbook update without the -inf guard
        m_new = torch.maximum(m, s.max(-1, keepdim=True).values)
        p = torch.exp(s - m_new)
        scale = torch.exp(m - m_new)
        return m_new, scale * l + p.sum(-1, keepdim=True), scale * acc + p @ v
    assert not exercises.check("09.3", nan_on_empty_rows)
    assert not exercises.check("09.3", 3)


def test_09_4_crossover_by_hand():
    from minillm.model.config import get_config
    cfg = get_config("llama-3-8b")
    kv_per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 2          # K and V, bf16
    weights = cfg.num_params * 2
    assert exercises.check("09.4", weights / (4 * kv_per_token))
    assert not exercises.check("09.4", weights / kv_per_token)                 # one sequence
    assert not exercises.check("09.4", weights / (4 * kv_per_token / 2))       # K only
    assert not exercises.check("09.4", weights / (4 * kv_per_token * 4))       # all 32 heads, not 8


def test_09_5_merge():
    def merge(outs, lses):
        top = lses.max()
        w = torch.exp(lses - top)
        return (w[:, None] * outs).sum(0) / w.sum()
    assert exercises.check("09.5", merge)

    def no_shift(outs, lses):                   # overflows for scores near 800
        w = torch.exp(lses)
        return (w[:, None] * outs).sum(0) / w.sum()
    assert not exercises.check("09.5", no_shift)

    def plain_mean(outs, lses):                 # ignores how many keys each chunk saw
        return outs[torch.isfinite(lses)].mean(0)
    assert not exercises.check("09.5", plain_mean)
