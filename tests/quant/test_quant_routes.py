"""int8's W8A8 route, the per-machine route table, the quantized lm_head and the fallback line."""
import copy
import json
import warnings

import pytest
import torch

import minillm
from minillm.quant import routes, w8a8
from minillm.quant.api import quantize, quantized_bytes, set_path
from minillm.quant.formats import quantize_int8
from minillm.quant.linear import Int4Linear, Int8Linear
from fake_load import fake_load

from test_quant_weights import dequantized_twin, weight

needs_w8a8 = pytest.mark.skipif(not w8a8.available(), reason="no x86 quantized engine here")


def _x(rows=6, k=128, seed=1):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[1] *= 50.0                                          # a loud token beside quiet ones
    x[2] = 0.0                                            # and a silent one
    return x


def _activation_bound(x, w64):
    """|y - x @ w^T| per element when each activation is rounded to its row's 8-bit grid: the
    grid's step is 2 a / 127 (a = the row's abs-max, range [-1, 1] after dividing by it), so an
    activation moves by at most half a step, a / 127, and the product by a / 127 * sum |w|."""
    a = x.double().abs().amax(1, keepdim=True)                              # (M, 1)
    return a / 127 * w64.abs().sum(1)[None, :] * (1 + 1e-5) + 1e-5         # (M, N)


def _within(y, x, w64):
    return bool(((y.double() - x.double() @ w64.t()).abs() <= _activation_bound(x, w64)).all())


@needs_w8a8
def test_w8a8_matches_the_dequantized_weight_within_activation_rounding():
    layer = Int8Linear(quantize_int8(weight()), path="fast", route="w8a8")
    w64 = layer.dequantize().double()
    x = _x()
    y = layer(x)
    assert y.shape == (6, 96) and y.dtype == torch.float32
    assert _within(y, x, w64)
    assert torch.equal(y[2], torch.zeros(96))             # a zero row gives exactly zero
    # the bound can fail: a result not scaled back per token, or shifted by a row, is caught
    packed = w8a8.prepack(layer.qweight, layer.scales)
    a = x.abs().amax(1, keepdim=True)
    assert not _within(w8a8.linear_w8a8(x, packed) / a.clamp_min(1e-30), x, w64)
    assert not _within(w8a8.linear_w8a8(x, packed).roll(1, 0), x, w64)


@needs_w8a8
def test_w8a8_row_is_the_same_alone_and_inside_a_batch():
    layer = Int8Linear(quantize_int8(weight()), path="fast", route="w8a8")
    x = _x(rows=8)
    together = layer(x)
    for i in range(8):
        assert torch.equal(layer(x[i:i + 1])[0], together[i])
    # the kernel alone scales the whole batch at once: a loud companion changes a quiet row
    packed = w8a8.prepack(layer.qweight, layer.scales)
    plain = torch.ops.quantized.linear_dynamic(x, packed, True)
    assert not torch.equal(torch.ops.quantized.linear_dynamic(x[:1], packed, True)[0], plain[0])


def test_routes_are_checked_and_reads_counted():
    q = quantize_int8(weight())
    with pytest.raises(ValueError, match="route must be one of"):
        Int8Linear(q, route="int4pack")
    ref = Int8Linear(q, path="reference")
    assert ref.read_nbytes() == ref.nbytes == 96 * 128 + 4 * 96
    if w8a8.available():
        fast = Int8Linear(q, path="fast", route="w8a8")
        assert fast.read_nbytes() == w8a8.packed_nbytes(96, 128) == fast.kernel_nbytes


@pytest.fixture
def quiet(monkeypatch):
    """The route table is only saved from a quiet machine: pretend this one is."""
    fake_load(monkeypatch, others=0.0, cores=64)
    monkeypatch.setattr(routes, "_PROCESS", {})


def test_route_table_is_cached_and_never_reused_across_machines(tmp_path, quiet, monkeypatch,
                                                                 one_thread):
    model = quantize(minillm.tiny_model(), "int8", path="reference")
    set_path(model, "auto")
    default = routes.choose_routes(model, cache_dir=tmp_path)      # weight-only, nothing timed
    assert {c["route"] for c in default.values()} == {"int8pack"} and not list(tmp_path.iterdir())
    first = routes.choose_routes(model, cache_dir=tmp_path, allow_w8a8=True)
    assert first and {c["source"] for c in first.values()} == {"timed"}
    for name, mods in routes.groups(model).items():       # each shape runs its chosen route
        assert {m.route for m in mods} == {first[name]["route"]}
        assert first[name]["route"] in Int8Linear.ROUTES
    monkeypatch.setattr(routes, "_PROCESS", {})
    again = routes.choose_routes(model, cache_dir=tmp_path, allow_w8a8=True)
    assert {c["source"] for c in again.values()} == {"cache"}
    (path,) = tmp_path.glob("quant_*.json")
    data = json.loads(path.read_text())
    assert data["key"]["threads"] == 1 and "cpu" in data["key"] and "torch" in data["key"]
    for field, other in (("threads", 7), ("torch", "0.0.1"), ("cpu", "another CPU")):
        foreign = dict(data, key={**data["key"], field: other})
        path.write_text(json.dumps(foreign))
        monkeypatch.setattr(routes, "_PROCESS", {})
        assert {c["source"] for c in routes.choose_routes(model, cache_dir=tmp_path,
                                                          allow_w8a8=True).values()} \
            == {"timed"}, field


def test_pick_takes_the_least_time_over_both_row_counts():
    assert routes.pick({"a": {1: 1.0, 8: 9.0}, "b": {1: 2.0, 8: 3.0}}) == "b"
    assert routes.pick({"a": {1: 1.0, 8: 9.0}, "b": {1: 2.0, 8: 3.0}}, ("a",)) == "a"
    assert routes.pick({}) is None


def test_a_format_without_a_fast_kernel_says_so_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = quantize(minillm.tiny_model(), "int4", group_size=16, lm_head="int4")
        model(torch.tensor([[1, 2, 3]]))
    lines = [str(w.message) for w in caught if "no fast" in str(w.message)]
    assert len(lines) == 1 and "int4" in lines[0] and "cpu" in lines[0]
    assert all(m.active_path() == "reference" for m in model.modules()
               if isinstance(m, Int4Linear))


@pytest.mark.parametrize("head", ["int8", "int4"])
def test_quantized_lm_head_is_the_dequantized_copy_and_the_embedding_stays(head, one_thread):
    fp = minillm.tiny_model()
    q = quantize(copy.deepcopy(fp), "int8", lm_head=head, path="reference")
    assert isinstance(q.lm_head, Int8Linear if head == "int8" else Int4Linear)
    assert torch.equal(q.embed.weight, fp.embed.weight)   # the lookup keeps the fp32 table
    twin = dequantized_twin(q, fp)
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(q(x), twin(x))
    counted = quantized_bytes(q)
    cfg = q.config
    norms = 4 * (2 * cfg.n_layer + 1) * cfg.d_model
    qbytes = sum(m.nbytes for m in q.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    # a step reads the quantized weights, the norms and one embedding row per token
    assert counted["read_per_step"] == qbytes + norms + 4 * cfg.d_model
    assert counted["embedding"] == 4 * cfg.vocab_size * cfg.d_model
    assert counted["total"] == qbytes + norms + counted["embedding"]
    with pytest.raises(ValueError, match="lm_head must be one of"):
        quantize(minillm.tiny_model(), "int8", lm_head="int2")


def test_front_door_quantize_forwards_every_argument():
    """`minillm.quantize` takes every argument of `quant.api.quantize`, with the same defaults,
    and passes them on: lm_head="int8" through the front door gives an int8 output projection."""
    import inspect
    import minillm
    from minillm.quant import api
    from minillm.quant.linear import Int8Linear
    front, inner = inspect.signature(minillm.quantize), inspect.signature(api.quantize)
    assert list(front.parameters) == list(inner.parameters)
    assert all(front.parameters[k].default == p.default for k, p in inner.parameters.items())
    model = minillm.quantize(minillm.tiny_model(), "int8", lm_head="int8", path="reference")
    assert isinstance(model.lm_head, Int8Linear)
