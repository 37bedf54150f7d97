"""The IO model (minillm/attention/io_model.py) against its closed forms and a hand count, its
asymptotics, and `peak_bytes` (minillm/attention/memory.py) on allocations counted by hand."""
import pytest
import torch

from minillm.attention import attention_reference, flash_attention
from minillm.attention.io_model import (IOCount, flash_block_sizes, io_flash, io_flash_formula,
                                        io_flash_query_outer, io_flash_query_outer_formula,
                                        io_standard, io_standard_formula)
from minillm.attention.memory import peak_bytes

CASES = [(8, 2, 16), (100, 16, 1000), (1000, 64, 25_000), (4096, 64, 49_152), (8192, 128, 98_304),
         (777, 32, 4 * 32), (5, 64, 10**6)]


@pytest.mark.parametrize("N,d,M", CASES)
def test_walked_counts_equal_the_closed_forms(N, d, M):
    assert io_standard(N, d) == io_standard_formula(N, d)
    assert io_flash(N, d, M) == io_flash_formula(N, d, M)
    assert io_flash_query_outer(N, d, M) == io_flash_query_outer_formula(N, d, M)


def test_a_count_by_hand():
    # N 8, d 2, M 16: B_c = ceil(16 / 8) = 2, B_r = min(2, 2) = 2: 4 key tiles x 4 query tiles.
    # K, V read once: 2*8*2 = 32; per (i, j): Q_i, O_i (2*2 each) and l_i, m_i (2 each) read = 12,
    # O_i, l_i, m_i stored = 8; 16 pairs.
    assert flash_block_sizes(2, 16) == (2, 2)
    assert io_flash(8, 2, 16) == IOCount(reads=32 + 16 * 12, writes=16 * 8)
    # standard: Q, K, V (16 each), S and P read once each (64 + 64); S, P (64 each) and O (16) stored
    assert io_standard(8, 2) == IOCount(reads=48 + 128, writes=128 + 16)
    # query-outer: Q read once (16), 4 query tiles x K, V (32 each... 2 * 8 * 2 = 32): 16 + 4 * 32
    assert io_flash_query_outer(8, 2, 16) == IOCount(reads=16 + 4 * 32, writes=8 * 3)


def test_block_sizes_follow_the_paper():
    assert flash_block_sizes(64, 100_000) == (64, 391)          # B_c = ceil(M / 4d), B_r = min(B_c, d)
    assert flash_block_sizes(128, 1024) == (2, 2)


def test_tiled_traffic_is_quadratic_in_n_and_inverse_in_m():
    d, M = 64, 65_536                                           # B_c = 256
    t = [io_flash(n, d, M).total for n in (4096, 8192, 16384)]
    assert 3.8 < t[1] / t[0] < 4.0 and 3.85 < t[2] / t[1] < 4.0  # double N: ~4x, not 2x (not O(N))
    half = io_flash(8192, d, 2 * M).total / io_flash(8192, d, M).total
    assert 0.5 < half < 0.56                                    # double M: ~half
    q = [io_flash_query_outer(n, d, M).total for n in (4096, 8192)]
    assert 3.8 < q[1] / q[0] < 4.0


def test_standard_traffic_is_n_squared_and_tiled_wins_by_about_m_over_d2():
    d = 64
    s = [io_standard(n, d).total for n in (4096, 8192)]
    assert 3.8 < s[1] / s[0] < 4.0
    assert io_standard(8192, d).total > 4 * 8192 ** 2           # the 4 N^2 of S and P, written and read
    gain = [io_standard(8192, d).total / io_flash(8192, d, M).total for M in (2**16, 2**17, 2**18)]
    assert 1.9 < gain[1] / gain[0] < 2.1 and 1.9 < gain[2] / gain[1] < 2.1
    assert gain[2] > 15                                        # M = 2^18 elements = 64 d^2


def test_bad_io_arguments():
    with pytest.raises(ValueError, match="M must be an int >= 256"):
        io_flash(100, 64, 255)
    with pytest.raises(ValueError, match="N must be an int >= 1"):
        io_standard(0, 64)
    with pytest.raises(TypeError, match="d must be an int"):
        io_flash(100, 64.0, 1000)


# ---- peak_bytes --------------------------------------------------------------------------------
def chain(x):
    y = x * 2                     # 4000 bytes
    z = y + 1                     # 4000 more while y lives
    return z


def loop(x):
    for _ in range(5):
        x = x + 1                 # each step frees the previous one: at most two alive
    return x


@pytest.mark.parametrize("fn,want", [
    (lambda x: x + 1, 4000),
    (chain, 8000),
    (loop, 8000),
    (lambda x: x.add_(1), 0),                                 # in place: nothing new
    (lambda x: x[::2].view(-1, 10).t(), 0),                   # views: nothing new
    (lambda x: (x * 2).sum(), 4004),                          # the temporary and the 0-d result
    (lambda x: x.double(), 8000),
    (lambda x: torch.cat([x, x]), 8000),
])
def test_peak_bytes_on_allocations_counted_by_hand(fn, want):
    x = torch.zeros(1000)
    result, peak = peak_bytes(fn, x)
    assert peak == want


def test_peak_bytes_matmul_and_softmax():
    a, b = torch.zeros(30, 40), torch.zeros(40, 50)
    assert peak_bytes(lambda a, b: a @ b, a, b)[1] == 30 * 50 * 4
    assert peak_bytes(lambda a: torch.softmax(a, -1), a)[1] == 30 * 40 * 4
    result, _ = peak_bytes(torch.add, a, 1.0)
    assert torch.equal(result, a + 1)


def test_peak_bytes_is_the_same_on_the_meta_device():
    peaks = []
    for dev in ("cpu", "meta"):
        q, k, v = torch.zeros(1, 9, 200, 16, device=dev), torch.zeros(1, 3, 200, 16, device=dev), torch.zeros(1, 3, 200, 16, device=dev)
        peaks.append((peak_bytes(attention_reference, q, k, v)[1], peak_bytes(flash_attention, q, k, v)[1]))
    assert peaks[0] == peaks[1]


def test_the_scores_matrix_is_what_disappears():
    """Dense peak grows as N^2 (it holds (H, N, N) scores), tiled as N (the output; tiles are fixed)."""
    peaks = {}
    for n in (256, 512):
        q, k, v = (torch.zeros(1, h, n, 64, device="meta") for h in (9, 3, 3))
        peaks[n] = peak_bytes(attention_reference, q, k, v)[1], peak_bytes(flash_attention, q, k, v)[1]
    assert peaks[512][0] >= 2 * 9 * 512 * 512 * 4               # scores and their masked copy at once
    assert 3.5 < peaks[512][0] / peaks[256][0] < 4.1
    # tiled: the same tiles at any N; what grows is the output and its log-sum-exp, 256 rows more
    assert peaks[512][1] - peaks[256][1] == 9 * 256 * (64 + 1) * 4
    assert peaks[512][1] * 8 < peaks[512][0]


def test_bench_prefill_quick_record(tmp_path):
    import json
    from benchmarks.attention import run_prefill
    r = run_prefill(quick=True, out_dir=tmp_path)
    saved = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert saved["units"] and saved["memory"]["1024"]["tiled64_over_dense"] < 1 / 8
    assert r["memory"]["512"]["scores_bytes"] == 9 * 512 * 512 * 4
    assert set(saved["timing"]["256"]) >= {"sdpa", "dense", "tiled128", "dense_over_sdpa"}
