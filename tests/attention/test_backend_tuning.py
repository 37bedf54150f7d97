"""attention_backend="auto": the paged / flash-decoding crossover is decided from timings (a pure
function), timed once per machine and cached, and either path gives the engine the same tokens.
Nothing here depends on which path is faster on the machine that runs it."""
import json

import pytest
import torch

import minillm.attention.backends as bt
import minillm.paging.paged_cache as pc
from minillm import EngineConfig, LLMEngine, SamplingParams, tiny_model
from minillm.attention import flash_decoding as fd
from minillm.attention.metadata import PagedAttentionMetadata
from minillm.kernels import cpu_tuning
from minillm.paging.paged_cache import PagedKVCache


def _times(wins):
    """Fake timings over the grid: flash-decoding wins where `wins` says so."""
    return {p: {"paged": 2.0, "flash_decoding": 1.0 if w else 3.0} for p, w in zip(bt.GRID, wins)}


def test_decide_is_the_smallest_step_from_which_flash_decoding_always_wins():
    keys = sorted(b * s for b, s in bt.GRID)
    assert bt.decide(_times([True] * 6)) == keys[0]
    assert bt.decide(_times([False] * 6)) is None
    by_keys = sorted(bt.GRID, key=lambda p: p[0] * p[1])
    wins = {p: i >= 3 for i, p in enumerate(by_keys)}                 # the three largest win
    assert bt.decide(_times([wins[p] for p in bt.GRID])) == by_keys[3][0] * by_keys[3][1]
    wins[by_keys[1]] = True                                            # a lone win below: ignored
    assert bt.decide(_times([wins[p] for p in bt.GRID])) == by_keys[3][0] * by_keys[3][1]
    wins[by_keys[-1]] = False                                          # loses at the largest
    assert bt.decide(_times([wins[p] for p in bt.GRID])) is None


def test_threshold_is_timed_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake_time(*args, **kwargs):
        calls.append(args)
        return _times([False, False, True, True, True, True])
    monkeypatch.setattr(bt, "time_backends", fake_time)
    cpu_tuning._MEMORY.clear()
    first = bt.decode_threshold(9, 3, 64, cache_dir=tmp_path)
    assert first == bt.decide(fake_time()) and len(calls) == 2
    cpu_tuning._MEMORY.clear()                                         # a new process: the file
    assert bt.decode_threshold(9, 3, 64, cache_dir=tmp_path) == first and len(calls) == 2
    [path] = tmp_path.glob("decode_attention_*.json")
    path.write_text("{not json")                                       # corrupt: timed again
    cpu_tuning._MEMORY.clear()
    assert bt.decode_threshold(9, 3, 64, cache_dir=tmp_path) == first and len(calls) == 3
    assert json.loads(path.read_text())["threshold"] == first
    with pytest.raises(ValueError, match="head_dim"):
        bt.decode_threshold(9, 3, 0, cache_dir=tmp_path)


def test_time_backends_runs_both_paths_on_a_small_grid():
    out = bt.time_backends(4, 2, 8, grid=((1, 300), (2, 520)), rounds=1, max_rounds=2)
    assert set(out) == {(1, 300), (2, 520)}
    assert all(t["paged"] > 0 and t["flash_decoding"] > 0 for t in out.values())


@pytest.mark.parametrize("threshold", [1, None])
def test_auto_gives_the_paged_tokens_and_takes_the_path_it_decided(threshold, monkeypatch):
    """Prompts longer than one chunk, so "auto" asks for the crossover: forced to 1 every decode
    step goes through flash-decoding; forced to None none does. Tokens equal "paged" either way."""
    model = tiny_model(vocab_size=128, seed=0, dtype=torch.float64)
    prompts = [[(7 * i + j) % 128 for j in range(fd.CHUNK + 20 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    paged = LLMEngine(model, EngineConfig(attention_backend="paged"))
    ref = [o.token_ids for o in paged.generate(prompts, params)]
    monkeypatch.setattr(bt, "decode_threshold", lambda *a, **k: threshold)
    used = []
    real = pc.flash_decode                                             # as the cache calls it
    monkeypatch.setattr(pc, "flash_decode", lambda *a, **k: used.append(1) or real(*a, **k))
    engine = LLMEngine(model, EngineConfig(attention_backend="auto"))
    assert [o.token_ids for o in engine.generate(prompts, params)] == ref
    assert bool(used) == (threshold is not None)


def test_auto_never_times_short_contexts(monkeypatch):
    def no_timing(*a, **k):
        raise AssertionError("timed although no context spans more than one chunk")
    monkeypatch.setattr(bt, "decode_threshold", no_timing)
    model = tiny_model(vocab_size=128, seed=0, dtype=torch.float64)
    engine = LLMEngine(model, EngineConfig(attention_backend="auto"))
    engine.generate([[1, 2, 3] * 10] * 4, SamplingParams(max_tokens=5, ignore_eos=True))
    assert PagedKVCache(model.config, 4, 4, attention_backend="auto").attention_backend == "auto"


@pytest.mark.parametrize("crossover", [None, 600, 10**9])
def test_choice_asks_the_crossover_once_and_follows_it(crossover, monkeypatch):
    """BackendChoice("auto") times nothing for one-chunk contexts, asks `decode_threshold` once
    (a None answer, "never", is remembered too), plans flash-decoding from the crossover on, and
    never for a step with a prefill chunk; "paged" / "flash_decoding" need no crossover."""
    calls = []
    monkeypatch.setattr(bt, "decode_threshold", lambda *a, **k: calls.append(a) or crossover)
    choice = bt.BackendChoice("auto", n_kv_head=1, head_dim=4)
    q = torch.zeros(2, 2, 4)                                               # (B, H, D)
    short = PagedAttentionMetadata([1, 1], [fd.CHUNK, 3], [[0], [1]], fd.CHUNK)
    assert choice.decode_plan(q, short) is None and not calls and not choice.crossover_known
    long = PagedAttentionMetadata([1, 1], [fd.CHUNK + 50, 9], [[0, 1], [2]], fd.CHUNK)
    for _ in range(3):                                                     # 2 x 306 keys
        plan = choice.decode_plan(q, long)
        assert (plan is not None) == (crossover is not None and 2 * (fd.CHUNK + 50) >= crossover)
    assert len(calls) == 1 and choice.crossover_known and choice.crossover == crossover
    assert calls[0][:3] == (2, 1, 4)                                       # H, Hkv, D of the step
    prefill = PagedAttentionMetadata([1, 2], [fd.CHUNK + 50, 9], [[0, 1], [2]], fd.CHUNK)
    assert choice.decode_plan(torch.zeros(3, 2, 4), prefill) is None
    assert bt.BackendChoice("paged", 1, 4).decode_plan(q, long) is None
    assert isinstance(bt.BackendChoice("flash_decoding", 1, 4).decode_plan(q, short), fd.DecodePlan)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="attention_backend"):
        bt.BackendChoice("flash", 1, 4)
