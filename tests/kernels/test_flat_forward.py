"""The flat forward pass (minillm.kernels.flat_forward) against the reference model's own forward.

The reference is `llama.py`'s module-by-module forward on the same weights. The flat loop runs
the same ops on the same values, so the two must agree bit for bit, in float64 and in float32
under every matmul route, for every cache the model talks to (none, contiguous, paged, ragged
batches with prefill chunks and decodes mixed); and the flat loop must step aside whenever it
would not compute the same function (autograd, a replaced layer, a bias, 16-bit weights, a hook
on a layer it would not call).
"""
import pytest
import torch
import torch.nn as nn

import minillm
from minillm.kernels import cpu_kernels as ck
from minillm.kernels import cpu_tuning
from minillm.kernels.flat_forward import FlatTransformer, flatten, unflatten
from minillm.model.kv_cache import KVCache
from minillm.paging.paged_cache import PagedKVCache


def _pair(dtype=torch.float64, **cfg):
    """The same tiny model twice: the reference class and a flattened copy of it."""
    ref = minillm.tiny_model(dtype=dtype, n_layer=3, **cfg)
    flat = minillm.tiny_model(dtype=dtype, n_layer=3, **cfg)
    assert type(flatten(flat)) is FlatTransformer and type(ref) is minillm.Transformer
    return ref, flat


def _close(a, b):
    assert a.shape == b.shape and torch.equal(a, b), (a - b).abs().max()


@torch.inference_mode()
def test_no_cache_batch_and_logits_index():
    ref, flat = _pair()
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(0))
    assert flat.flat_ok(ids)
    _close(flat(ids), ref(ids))
    idx = torch.tensor([4, 10])
    _close(flat(ids, logits_index=idx), ref(ids, logits_index=idx))


@torch.inference_mode()
def test_contiguous_cache_prefill_then_decode():
    ref, flat = _pair()
    caches = [KVCache(m.config, 2, 32, dtype=torch.float64) for m in (ref, flat)]
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    outs = [m(ids, torch.arange(7), c) for m, c in zip((ref, flat), caches)]
    _close(outs[1], outs[0])
    for step in range(4):
        tok = outs[0][:, -1].argmax(-1, keepdim=True)                    # (2, 1)
        pos = torch.tensor([7 + step])
        outs = [m(tok, pos, c) for m, c in zip((ref, flat), caches)]
        _close(outs[1], outs[0])
    _close(caches[1].k, caches[0].k)                                      # same keys stored
    _close(caches[1].v, caches[0].v)


@torch.inference_mode()
def test_paged_ragged_batch_with_prefill_and_decodes():
    ref, flat = _pair()
    lens = [(1, 9), (5, 5), (1, 17), (3, 12)]                             # (query, context)
    tables = [[0, 1], [2], [3, 4, 5], [6, 7]]
    caches = []
    for m in (ref, flat):
        c = PagedKVCache(m.config, 8, 8, dtype=torch.float64)
        g = torch.Generator().manual_seed(2)
        c.k.copy_(torch.randn(c.k.shape, generator=g, dtype=torch.float64))
        c.v.copy_(torch.randn(c.v.shape, generator=g, dtype=torch.float64))
        c.prepare([q for q, _ in lens], [s for _, s in lens], tables)
        caches.append(c)
    M = sum(q for q, _ in lens)
    ids = torch.randint(0, 256, (1, M), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(s - q, s) for q, s in lens])
    outs = [m(ids, pos, c) for m, c in zip((ref, flat), caches)]
    _close(outs[1], outs[0])
    _close(caches[1].k, caches[0].k)


@pytest.mark.parametrize("backend,kv_dtype", [("flash_decoding", "auto"), ("paged", "int8")])
@torch.inference_mode()
def test_paged_rows_protocol_under_flash_decoding_and_int8(backend, kv_dtype):
    """The flat loop hands the paged cache rows (`attend_rows`), never `attend`; the reference
    hands it heads-first tensors. Both must store and read the same keys under every backend."""
    ref, flat = _pair()
    caches = [PagedKVCache(m.config, 12, 8, dtype=torch.float64, kv_cache_dtype=kv_dtype,
                           attention_backend=backend) for m in (ref, flat)]
    caches[1].attend = None                                   # the flat loop must not call it
    lens, tables = [(9, 9), (20, 20)], [[0, 1], [2, 3, 4]]   # two prompts, then decodes
    M = sum(q for q, _ in lens)
    ids = torch.randint(0, 256, (1, M), generator=torch.Generator().manual_seed(7))
    for step in range(3):
        pos = torch.cat([torch.arange(s - q, s) for q, s in lens])
        for c in caches:
            c.prepare([q for q, _ in lens], [s for _, s in lens], tables)
        outs = [m(ids, pos, c) for m, c in zip((ref, flat), caches)]
        _close(outs[1], outs[0])
        ids = outs[0][0, torch.tensor([q for q, _ in lens]).cumsum(0) - 1].argmax(-1)[None]
        lens = [(1, s + 1) for _, s in lens]
    _close(caches[1].k, caches[0].k)


def test_a_replaced_weight_is_read_on_the_next_call():
    ref, flat = _pair()
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        _close(flat(ids), ref(ids))
        for m in (ref, flat):
            m.layers[1].attn.qkv_proj.weight = nn.Parameter(
                torch.ones_like(m.layers[1].attn.qkv_proj.weight) / 64)
            m.layers[2].input_norm.weight = nn.Parameter(torch.full((64,), 3.0, dtype=torch.float64))
        assert flat.flat_ok(ids)
        _close(flat(ids), ref(ids))


@torch.inference_mode()
def test_float32_routes_agree_bit_for_bit_with_the_reference():
    ref, flat = _pair(torch.float32)
    for m in (ref, flat):
        cpu_tuning.accelerate(m, route="ksplit")
    unflatten(ref)                                        # RoutedLinear layers, reference forward
    assert type(flat) is FlatTransformer and type(ref) is minillm.Transformer
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    for route in [r for r in ck.ROUTES if r != "auto"]:
        with ck.linear_route(route):
            _close(flat(ids), ref(ids))
    cpu_tuning.plain(flat)
    assert type(flat) is minillm.Transformer


def test_steps_aside_where_it_would_differ():
    ref, flat = _pair()
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert flat.flat_ok(ids)
    assert not flat.flat_ok(ids)                                          # autograd on
    with torch.inference_mode():
        seen = []
        top = flat.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        _close(flat(ids), ref(ids))
        assert seen == [(1, 6, 256)]                                      # a hook on the model runs
        top.remove()
        handle = flat.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        assert not flat.flat_ok(ids)                # a hooked layer: the reference forward runs it
        _close(flat(ids), ref(ids))
        assert seen == [(1, 6, 256), (1, 6, 64)]
        handle.remove()
        pre = flat.layers[0].input_norm.register_forward_pre_hook(lambda m, i: seen.append("pre"))
        assert not flat.flat_ok(ids)
        flat(ids)
        assert seen[-1] == "pre"
        pre.remove()
        assert flat.flat_ok(ids)                    # no hook left: the flat loop again
        cpu_tuning.plain(flat)                      # and plain() gives llama.py's forward back
        _close(flat(ids), ref(ids))
        flatten(flat)

    class Scaled(nn.Linear):                                              # a replaced projection
        def forward(self, x):
            return 2 * super().forward(x)
    for m in (ref, flat):
        m.layers[0].attn.o_proj.__class__ = Scaled
    with torch.inference_mode():
        assert not flat.flat_ok(ids)
        _close(flat(ids), ref(ids))
    for m in (ref, flat):
        m.layers[0].attn.o_proj.__class__ = nn.Linear

    class Shifted(type(flat.layers[1].mlp)):                             # a replaced module object
        def forward(self, x):
            return super().forward(x) + 1
    with torch.inference_mode():
        flat(ids)                                                         # modules listed
        for m in (ref, flat):
            mlp = Shifted.__new__(Shifted)
            mlp.__dict__ = dict(m.layers[1].mlp.__dict__)
            m.layers[1].mlp = mlp
        assert not flat.flat_ok(ids)
        _close(flat(ids), ref(ids))
        for m in (ref, flat):                                             # a bias the loop would drop
            m.layers[1].mlp.__class__ = type(m.layers[0].mlp)
            m.layers[2].attn.o_proj.bias = nn.Parameter(torch.full((64,), 0.5, dtype=torch.float64))
        assert not flat.flat_ok(ids)
        _close(flat(ids), ref(ids))
        for m in (ref, flat):
            m.layers[2].attn.o_proj.bias = None
        assert flat.flat_ok(ids)
        flat.layers.append(flat.layers[0])                                # one more layer
        ref.layers.append(ref.layers[0])
        assert flat.flat_ok(ids)
        _close(flat(ids), ref(ids))
    bf = flatten(minillm.tiny_model(dtype=torch.bfloat16))
    with torch.inference_mode():
        assert not bf.flat_ok(ids)


def test_gradients_take_the_reference_path():
    ref, flat = _pair()
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(6))
    flat(ids).sum().backward()
    ref(ids).sum().backward()
    _close(flat.layers[0].attn.qkv_proj.weight.grad, ref.layers[0].attn.qkv_proj.weight.grad)


def test_flatten_is_reversible_and_keeps_the_state_dict():
    ref, flat = _pair()
    assert list(flat.state_dict()) == list(ref.state_dict())
    assert type(unflatten(flat)) is minillm.Transformer
    assert flatten(nn.Linear(2, 2)).__class__ is nn.Linear                 # others untouched


@pytest.mark.slow
def test_real_model_greedy_tokens_match_the_reference():
    model, tok = minillm.load_model(device="cpu")
    assert type(model) is FlatTransformer                     # the front door's load_model default
    prompt = minillm.encode_chat(tok, "Name three colours.")
    flat_tokens = minillm.generate(model, prompt, 12)
    unflatten(model)
    try:
        ref_tokens = minillm.generate(model, prompt, 12)
    finally:
        flatten(model)
    assert flat_tokens == ref_tokens


@torch.inference_mode()
def test_paged_cache_refuses_an_unflattened_batch_in_both_forwards():
    for m in _pair():
        cache = PagedKVCache(m.config, 4, 8, dtype=torch.float64)
        cache.prepare([3, 3], [3, 3], [[0], [1]])
        with pytest.raises(ValueError, match="flattened batch"):
            m(torch.zeros(2, 3, dtype=torch.long), torch.arange(3), cache)


def test_return_hidden_is_the_final_norm_output_in_both_forwards():
    """The features chapter 10's drafters read: lm_head(hidden) is the logits, bit for bit, and
    the flat loop returns what the reference forward returns."""
    from minillm.kernels.flat_forward import flatten, unflatten
    model = minillm.tiny_model(seed=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_logits, ref_hidden = model(ids, return_hidden=True)
        assert ref_hidden.shape == (1, 7, model.config.d_model)
        torch.testing.assert_close(model.lm_head(ref_hidden), ref_logits, rtol=0, atol=0)
        torch.testing.assert_close(model(ids), ref_logits, rtol=0, atol=0)
        last, hidden_last = model(ids, logits_index=torch.tensor([6]), return_hidden=True)
        torch.testing.assert_close(last, ref_logits[:, 6:])   # one row's matmul: ULPs apart
        torch.testing.assert_close(hidden_last, ref_hidden, rtol=0, atol=0)
        flatten(model)
        try:
            assert model.flat_ok(ids)
            flat_logits, flat_hidden = model(ids, return_hidden=True)
        finally:
            unflatten(model)
    torch.testing.assert_close(flat_hidden, ref_hidden, rtol=0, atol=0)
    torch.testing.assert_close(flat_logits, ref_logits, rtol=0, atol=0)
