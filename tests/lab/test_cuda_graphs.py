"""StaticKVCache against dense attention and the contiguous KVCache; CUDA graphs on a GPU only."""
import pytest
import torch

from minillm import KVCache, tiny_model
from minillm.lab.cuda_graphs import (GraphDecoder, StaticKVCache, forward_static,
                                 measure_launch_overhead)

F64 = torch.float64


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=97, seed=3, dtype=F64)


def _sequence(n, batch=1, seed=0):
    return torch.randint(97, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch", [1, 2])
@torch.inference_mode()
def test_static_cache_matches_dense_and_kvcache(model, batch):
    ids = _sequence(12, batch)
    dense = model(ids)                                              # (B, 12, V): no cache at all
    static = StaticKVCache(model.config, batch, 32, dtype=F64)
    contiguous = KVCache(model.config, batch, 32, dtype=F64)
    got = [forward_static(model, static, ids[:, :7], torch.arange(7))]
    ref = [model(ids[:, :7], torch.arange(7), contiguous)]
    for p in range(7, 12):                                          # one token at a time
        got.append(forward_static(model, static, ids[:, p:p + 1], torch.tensor([p])))
        ref.append(model(ids[:, p:p + 1], torch.tensor([p]), contiguous))
    got, ref = torch.cat(got, 1), torch.cat(ref, 1)
    torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@torch.inference_mode()
def test_static_cache_rewrite_and_stale_slots_are_masked(model):
    ids, other = _sequence(10), _sequence(10, seed=1)
    static = StaticKVCache(model.config, 1, 16, dtype=F64)
    forward_static(model, static, other, torch.arange(10))          # fill 10 slots with junk
    forward_static(model, static, ids[:, :6], torch.arange(6))      # overwrite 0..5; 6..9 stale
    got = forward_static(model, static, ids[:, 6:7], torch.tensor([6]))
    torch.testing.assert_close(got[:, -1], model(ids[:, :7])[:, -1], rtol=1e-10, atol=1e-10)


def test_static_cache_bad_input(model):
    with pytest.raises(ValueError, match="batch_size"):
        StaticKVCache(model.config, 0, 16)
    with pytest.raises(ValueError, match="max_seq_len"):
        StaticKVCache(model.config, 1, model.config.max_seq_len + 1)
    cache = StaticKVCache(model.config, 1, 16, dtype=F64)
    with pytest.raises(ValueError, match="positions are required"):
        model(_sequence(2), cache=cache)                            # no positions: refused
    with pytest.raises(ValueError, match="share positions"):
        model(_sequence(2, batch=2), torch.arange(4).view(2, 2), StaticKVCache(model.config, 2, 16, dtype=F64))


def test_cpu_refuses_graphs_with_a_clear_error(model):
    with pytest.raises(RuntimeError, match="CUDA"):
        measure_launch_overhead(model, steps=4)
    with pytest.raises(RuntimeError, match="CUDA"):
        GraphDecoder(model, StaticKVCache(model.config, 1, 16, dtype=F64))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_graph_replay_matches_eager_decode_on_cuda():
    model = tiny_model(vocab_size=97, seed=3, dtype=torch.float32, device="cuda")
    ids = _sequence(12).cuda()
    dense = model(ids)[0]                                           # (12, V)
    cache = StaticKVCache(model.config, 1, 32, device="cuda")
    forward_static(model, cache, ids[:, :7], torch.arange(7, device="cuda"))
    decoder = GraphDecoder(model, cache)             # its warm-up must not spoil the prompt's KV
    for p in range(7, 12):
        logits = decoder.step(ids[:, p], p)                         # (1, V)
        torch.testing.assert_close(logits[0], dense[p], rtol=1e-4, atol=1e-4)
    r = measure_launch_overhead(model, steps=8)
    assert r["graph_ms_per_step"] > 0 and r["graph_max_abs_diff_vs_eager"] < 1e-3
