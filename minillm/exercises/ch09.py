"""Chapter 9's exercises (attention at long context). Keys "09.N" as numbered in the notebook.

09.1 is judged against `attention.flash_attention_stats` (the tile loop's own bounds), 09.2
against the IO model `attention.io_model` (no machine dependence). The numbers in the questions
are ones the chapter does not print (the tests grep every notebook's outputs for the answers).
09.3 runs the reader's online-softmax step on random tiles made when they check, including masked
(-inf) scores and a row whose first tile is entirely masked, against softmax(scores) @ v computed
in one go in float64. 09.4 against chapter 2's byte counts (`analysis.kv_math`) for Llama-3-8B;
09.5 runs the reader's merge of flash-decoding partials against one softmax over all keys,
written in plain Python.
"""
import math

import torch

from minillm.analysis.kv_math import kv_crossover_tokens
from minillm.exercises import call_reader, code, numeric
from minillm.model.config import get_config


def _tiles_computed() -> float:
    from minillm.attention import flash_attention_stats
    return flash_attention_stats(1300, 1300, causal=True, block_q=64, block_k=64).visited


def _io_ratio() -> float:
    from minillm.attention.io_model import io_flash, io_standard
    return io_standard(20480, 64).total / io_flash(20480, 64, 2 ** 18).total


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


numeric("09.1", "Causal FlashAttention with 64 x 64 tiles over T = S = 1300 tokens: how many "
        "(query tile, key tile) pairs does it compute (the others are skipped)?", _tiles_computed,
        rtol=0, atol=0.01, hint="recount the tiles per side (a last, partial tile counts), then how "
                                "many key tiles each query tile visits under the causal mask")
numeric("09.2", "N = 20480, d = 64, on-chip memory M = 2^18 elements: by what factor does standard "
        "attention move more elements between main memory and on-chip memory than FlashAttention "
        "(Algorithm 1, B_c = ceil(M/4d), B_r = min(B_c, d))? Count reads and writes.", _io_ratio,
        rtol=0.02, hint="recount both totals for this N and M: the tile sizes change, so does the "
                        "number of key tiles, and each key tile re-reads and re-writes the queries' "
                        "side (Q, O and the running l, m)")
code("09.3", "Write step(m, l, acc, s, v) -> (m, l, acc): fold one tile of scores s (rows, bk) and "
     "values v (bk, D) into the running max m (rows, 1), the running sum l (rows, 1) of exp(score - m) "
     "and the unnormalized output acc (rows, D). After the last tile acc / l must equal "
     "softmax(all scores) @ v, masked (-inf) scores included.", _test_online_step,
     hint="what l and acc summed under the old max must be rescaled when the max grows; a row "
          "whose max is still -inf must not compute -inf - (-inf)")


def _test_merge(candidate) -> None:
    """The reader's merge(outs (n, D), lses (n,)) -> (D,) against one softmax over all keys,
    written here in plain Python: scores near 800 (exp overflows float64 past 709 unless the
    largest lse is subtracted first), uneven chunks, and a chunk that saw no key."""
    if not callable(candidate):
        raise AssertionError("pass your function merge(outs, lses) -> the merged output (D,)")
    g = torch.Generator().manual_seed(9)
    for offset, sizes in ((0.0, (3, 1, 6)), (800.0, (5, 2, 4, 1)), (-50.0, (7,))):
        n = sum(sizes)
        scores = (offset + 3 * torch.randn(n, generator=g, dtype=torch.float64)).tolist()
        values = torch.randn(n, 4, generator=g, dtype=torch.float64)
        outs, lses, start = [], [], 0
        for size in sizes:
            s = torch.tensor(scores[start:start + size], dtype=torch.float64)
            outs.append(torch.softmax(s, 0) @ values[start:start + size])
            lses.append(torch.logsumexp(s, 0))
            start += size
        outs.append(torch.zeros(4, dtype=torch.float64))       # a chunk of padding only
        lses.append(torch.tensor(-math.inf, dtype=torch.float64))
        top = max(scores)
        w = [math.exp(s - top) for s in scores]
        want = [sum(wi * values[i, d].item() for i, wi in enumerate(w)) / sum(w) for d in range(4)]
        got = call_reader(candidate, torch.stack(outs), torch.stack(lses))
        if isinstance(got, tuple):                              # (out, lse) is fine too
            got = got[0]
        got = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
        if got.numel() != 4:
            raise AssertionError(f"return the merged output (D,) = (4,), got {got.numel()} numbers")
        if not torch.isfinite(got).all():
            raise AssertionError(f"the merge is not finite for scores near {offset:.0f}")
        if not torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-9, rtol=0):
            raise AssertionError(f"the merged output differs from one softmax over all keys "
                                 f"(scores near {offset:.0f}, chunks {sizes} + an empty one)")


numeric("09.4", "A batch of 4 Llama-3-8B sequences (get_config(\"llama-3-8b\")) decodes "
        "together, weights and KV cache both in bf16. At what context length (tokens per "
        "sequence) do the batch's KV bytes equal the model's weight bytes?",
        lambda: kv_crossover_tokens(get_config("llama-3-8b"), 4),
        rtol=0.01, hint="recompute the KV bytes one token adds for this model (every layer, K and "
                        "V, only the kv heads), for the whole batch, against its weight bytes")
code("09.5", "Write merge(outs, lses): outs (n, D) are n chunks' softmax-normalized outputs, "
     "lses (n,) their log-sum-exps -> the output (D,) of one softmax over all the keys. It must "
     "hold for scores near 800 and for a chunk that saw no key (lse = -inf).",
     _test_merge, hint="a chunk's lse says how much of the total exp-sum its keys hold: weigh the "
                       "chunks by that; shift every lse by the largest before any exp")
