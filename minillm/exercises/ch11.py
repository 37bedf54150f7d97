"""Chapter 11 exercises (past one machine). Numeric answers are judged against
`parallel_math`'s and `kv_math`'s formulas; the code exercise runs the reader's KV-head placement
against vLLM's rule for every tensor-parallel size a few real head counts allow.

    >>> from minillm import exercises
    >>> exercises.check("11.2", 1)                # doctest: +SKIP
    11.2 not yet: that is not it (...); recompute. Hint: ...
"""
from minillm.analysis.kv_math import kv_cache_bytes
from minillm.analysis.parallel_math import bubble_fraction, tp_collectives
from minillm.exercises import call_reader as _call, code, numeric
from minillm.model.config import get_config


numeric("11.1", "Llama-2-70B (80 layers, d_model 8192) with tensor_parallel_size=8 decodes a batch "
        "of 32 sequences (one new token each), its activations in bf16. How many bytes does one "
        "rank hand to all-reduces in that step?",
        lambda: tp_collectives(get_config("llama-2-70b"), 8, 32, 32,
                               dtype_bytes=2)["all_reduce"]["bytes"],
        rtol=0, atol=0.5, hint="section 3 counts the all-reduces of a step and the tensor each one "
        "sums; redo both for this model, batch and dtype")


def _fewest_microbatches(p: int, bubble: float) -> int:
    m = 1
    while bubble_fraction(p, m) >= bubble:
        m += 1
    return m


numeric("11.2", "A pipeline of 4 stages fed equal micro-batches (GPipe, forward only): what is the "
        "fewest micro-batches that brings the bubble below 10%?",
        lambda: _fewest_microbatches(4, 0.10), rtol=0, atol=0.5,
        hint="recompute section 5's bubble for 4 stages and growing m; below means strictly below")

def _kv_transfer_ms(tokens: int = 2048, link_gbit_s: float = 400) -> float:
    bits = kv_cache_bytes(get_config("llama-2-70b"), tokens, dtype="bf16") * 8
    return bits / (link_gbit_s * 1e9) * 1e3


numeric("11.3", "Disaggregated serving of Llama-2-70B with a bf16 KV cache, section 9's setup: how "
        "many milliseconds does the KV cache of one 2,048-token prompt take to cross a 400 Gb/s "
        "link (bandwidth only, no latency)?", _kv_transfer_ms, rtol=0.01,
        hint="recompute chapter 2's KV bytes for this model and prompt (section 6 checked that they "
        "are exactly what moves); mind the dtype, and that the link counts bits")


def _vllm_kv_heads(num_kv_heads: int, tp: int, rank: int) -> list[int]:
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // num_kv_heads)]


def _test_kv_heads(fn) -> None:
    """fn(num_kv_heads, tp, rank) -> the KV head indices rank `rank` holds."""
    for hkv in (1, 2, 3, 4, 8):
        for tp in (1, 2, 3, 4, 6, 8, 16):
            if hkv % tp and tp % hkv:
                continue                           # neither divides: no rank layout exists
            for rank in range(tp):
                want = _vllm_kv_heads(hkv, tp, rank)
                got = _call(fn, hkv, tp, rank)
                assert isinstance(got, (list, tuple)) and list(got) == want, (
                    f"{hkv} KV heads over tensor_parallel_size={tp}, rank {rank}: got {got!r}")


code("11.4", "Write kv_heads_for_rank(num_kv_heads, tp, rank) -> the list of KV-head indices that "
     "rank holds: split them evenly when tp divides num_kv_heads, and when tp is a multiple of "
     "num_kv_heads give each rank one head, replicated over consecutive ranks (vLLM's rule).",
     _test_kv_heads, hint="with more ranks than KV heads, neighbouring ranks share a head: work out how many "
     "share each one")
