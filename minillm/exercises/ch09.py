"""Chapter 9's exercises (attention at long context). Keys "09.N" as numbered in the notebook.

09.1 is judged against `attention.flash_attention_stats` (the tile loop's own bounds), 09.2
against the IO model `attention.io_model` (no machine dependence). 09.3 runs the reader's
online-softmax step on random tiles made when they check, including masked (-inf) scores and a
row whose first tile is entirely masked, against softmax(scores) @ v computed in one go in float64.
09.4 and 09.5 (flash-decoding) are registered by part B of the chapter.
"""
import torch

from minillm.exercises import call_reader, code, numeric


def _tiles_computed() -> float:
    from minillm.attention import flash_attention_stats
    return flash_attention_stats(1000, 1000, causal=True, block_q=64, block_k=64).visited


def _io_ratio() -> float:
    from minillm.attention.io_model import io_flash, io_standard
    return io_standard(8192, 64).total / io_flash(8192, 64, 2 ** 17).total


def _cases(seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    for rows, n, D, cut in ((3, 10, 2, 4), (5, 33, 4, 16), (2, 7, 3, 1), (4, 50, 8, 49)):
        s = torch.randn(rows, n, dtype=torch.float64, generator=g) * 5
        s[0, :cut] = float("-inf")                   # row 0: its whole first tile is masked
        s[1, ::3] = float("-inf")                    # row 1: scattered masked keys
        yield s, torch.randn(n, D, dtype=torch.float64, generator=g), cut


def _test_online_step(candidate) -> None:
    if not callable(candidate):
        raise AssertionError("pass your function step(m, l, acc, s, v) -> (m, l, acc)")
    for s, v, cut in _cases():
        rows, D = s.shape[0], v.shape[1]
        m = torch.full((rows, 1), float("-inf"), dtype=torch.float64)
        l, acc = torch.zeros(rows, 1, dtype=torch.float64), torch.zeros(rows, D, dtype=torch.float64)
        for lo, hi in ((0, cut), (cut, s.shape[1])):
            got = call_reader(candidate, m.clone(), l.clone(), acc.clone(), s[:, lo:hi].clone(), v[lo:hi].clone())
            if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
                raise AssertionError("return the tuple (m, l, acc) of tensors")
            m, l, acc = got
        out = acc / l
        if out.isnan().any():
            raise AssertionError("NaN in acc / l: a row whose tile is all -inf so far needs care")
        want = torch.softmax(s, -1) @ v
        if out.shape != want.shape or not torch.allclose(out, want, rtol=0, atol=1e-10):
            raise AssertionError(f"{s.shape[1]} keys in two tiles ({cut} + {s.shape[1] - cut}): "
                                 "acc / l is not softmax(s) @ v")


numeric("09.1", "Causal FlashAttention with 64 x 64 tiles over T = S = 1000 tokens: how many "
        "(query tile, key tile) pairs does it compute (the others are skipped)?", _tiles_computed,
        rtol=0, atol=0.01, hint="1000 tokens make ceil(1000/64) tiles per side; query tile i needs "
                                "key tiles 0..i")
numeric("09.2", "N = 8192, d = 64, on-chip memory M = 2^17 elements: by what factor does standard "
        "attention move more elements between main memory and on-chip memory than FlashAttention "
        "(Algorithm 1, B_c = ceil(M/4d), B_r = min(B_c, d))? Count reads and writes.", _io_ratio,
        rtol=0.02, hint="standard: Q, K, V, O once and S, P written and read (4 N^2); FlashAttention: "
                        "K, V once, then per key tile Q, O, l, m read and O, l, m written")
code("09.3", "Write step(m, l, acc, s, v) -> (m, l, acc): fold one tile of scores s (rows, bk) and "
     "values v (bk, D) into the running max m (rows, 1), the running sum l (rows, 1) of exp(score - m) "
     "and the unnormalized output acc (rows, D). After the last tile acc / l must equal "
     "softmax(all scores) @ v, masked (-inf) scores included.", _test_online_step,
     hint="when the max grows from m to m', multiply l and acc by exp(m - m'); a row whose max is "
          "still -inf must not compute -inf - (-inf)")
