"""minillm.lab.verify_cost on a tiny model: the table's arithmetic against the same numbers
worked out by hand from its own timings, the ridge and the roofline ratio against the roofline
formulas written out here, the int8 route against F.linear, and bad input. No speed is asserted."""
import re

import pytest
import torch
import torch.nn.functional as F

from minillm.analysis.roofline import Hardware
from minillm.lab.verify_cost import (TOLERANCE, format_verify_table, int8_matmuls, ridge_rows,
                                     roofline_ratio, verify_table)
from minillm.model.loading import tiny_model

HW = Hardware("toy", {"fp32": 4e11}, mem_bandwidth=1e10, mem_bytes=1e9)   # ridge 40 FLOP/byte


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _hand_intensity(cfg, n, context, w=4):
    """FLOPs / bytes of one verify forward (N new tokens, logits at each), written out here."""
    d, D, H, Hkv, L, V = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.n_layer, cfg.vocab_size
    keys = context + n
    flops, nbytes = 0.0, 0.0
    for k, out, layers in ((d, (H + 2 * Hkv) * D, L), (H * D, d, L), (d, 2 * cfg.d_ff, L),
                           (cfg.d_ff, d, L), (d, V, 1)):
        flops += layers * 2 * n * k * out
        nbytes += layers * (k * out + n * (k + out)) * w
    flops += L * 2 * (2 * H * n * keys * D)
    nbytes += L * 2 * (n * H * D + keys * Hkv * D) * w
    return flops / nbytes


def test_ridge_rows_is_where_the_hand_intensity_crosses_the_ridge(model):
    cfg = model.config
    r = ridge_rows(cfg, HW, "fp32", context=16)
    assert r is not None and r > 1
    assert _hand_intensity(cfg, r, 16) >= 40 > _hand_intensity(cfg, r - 1, 16)
    assert ridge_rows(cfg, HW, "fp32", context=16, max_rows=r - 1) is None


def test_roofline_ratio_flat_below_the_ridge_and_linear_far_above(model):
    cfg = model.config
    flat = Hardware("flat", {"fp32": 1e18}, mem_bandwidth=1e10, mem_bytes=1e9)  # never compute-bound
    assert roofline_ratio(cfg, flat, 1) == 1.0
    assert roofline_ratio(cfg, flat, 2) < 1.05                 # only activations and KV grow
    steep = Hardware("steep", {"fp32": 1e6}, mem_bandwidth=1e18, mem_bytes=1e9)  # always compute-bound
    assert roofline_ratio(cfg, steep, 8, context=0) == pytest.approx(
        _hand_flops(cfg, 8) / _hand_flops(cfg, 1), rel=1e-9)


def _hand_flops(cfg, n):
    """FLOPs of one verify forward over N new tokens with nothing cached."""
    d, D, H, Hkv, L, V = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.n_layer, cfg.vocab_size
    mm = sum(layers * 2 * n * k * out for k, out, layers in (
        (d, (H + 2 * Hkv) * D, L), (H * D, d, L), (d, 2 * cfg.d_ff, L), (cfg.d_ff, d, L), (d, V, 1)))
    return mm + L * 2 * (2 * H * n * n * D)


def test_table_arithmetic_matches_hand_computation(model):
    t = verify_table(model, rows=(2, 4), context=8, rounds=1, hardware=HW, int8=True)
    rows = t["rows"]
    assert [r["n"] for r in rows] == [1, 2, 4]                # N = 1 added as the reference
    f1, m1 = rows[0]["forward_ms"], rows[0]["matmuls_ms"]
    for r in rows:
        ratio = r["forward_ms"] / f1
        least = 1 + (r["matmuls_ms"] - m1) / f1
        assert r["ratio"] == pytest.approx(ratio, rel=0.01)
        assert r["least"] == pytest.approx(least, rel=0.01)
        assert r["other_ms"] == pytest.approx(r["forward_ms"] - r["matmuls_ms"], abs=0.02)
        assert r["gap"] == pytest.approx(r["ratio"] / r["least"] - 1, abs=0.02)
        if abs(ratio - least * (1 + TOLERANCE)) > 0.02:      # not on the edge after rounding
            assert r["within"] == (ratio <= least * (1 + TOLERANCE))
        assert r["roofline"] == pytest.approx(roofline_ratio(model.config, HW, r["n"], context=8), abs=1e-3)
        assert r["attention_ms"] > 0 and "int8_least" in r
        assert r["least_with_attention"] == pytest.approx(
            least + (r["attention_ms"] - rows[0]["attention_ms"]) / f1, abs=0.01)
    assert rows[0]["ratio"] == rows[0]["least"] == 1.0
    assert t["ridge_rows"] == ridge_rows(model.config, HW, "fp32", context=8)
    assert t["within_all"] == all(r["within"] for r in rows)
    assert (t["limit"] is None) == t["within_all"]
    assert t["noise"] == 0.0                                  # one round: no second round to compare
    text = format_verify_table(t)
    assert len(text.splitlines()) == 1 + len(rows) + 2 and "ridge" in text


def test_noise_is_the_largest_gap_between_a_case_s_two_fastest_rounds(model, monkeypatch):
    """Round r of every case takes (1, 1.3, 1.1)[r] ms on a fake clock, one case 2 ms in its
    first round: the two fastest rounds are 1 and 1.1 ms, or 1.1 and 1.3 ms for that case."""
    import types
    import minillm.lab.verify_cost as vc
    per_round, cases, calls = (1.0, 1.3, 1.1), 3 * 2, []   # forward, matmuls, attention at N = 1, 2

    def perf_counter():
        i = len(calls)
        calls.append(i)
        if i % 2 == 0:
            return float(i)
        case, r = (i // 2) % cases, (i // 2) // cases
        ms = 2.0 if (case, r) == (1, 0) else per_round[r]
        return (i - 1) + ms / 1e3
    monkeypatch.setattr(vc, "time", types.SimpleNamespace(perf_counter=perf_counter))
    t = vc.verify_table(model, rows=(2,), context=8, rounds=3, hardware=HW)
    assert len(calls) == 2 * 3 * cases
    assert t["noise"] == pytest.approx(max(1.1 / 1.0, 1.3 / 1.1) - 1, abs=1e-3)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_int8_route_computes_the_dequantized_product(model):
    """The int8 matmuls timed are the real ones: quantized::linear_dynamic on the prepacked
    weight is close to F.linear with the per-channel dequantized weight."""
    run = int8_matmuls(model, 3)
    if run is None:
        pytest.skip("no quantized engine in this torch")
    run()                                                        # runs without error
    w = model.layers[0].mlp.gate_up_proj.weight.detach()
    s = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    qw = torch.quantize_per_channel(w, s, torch.zeros_like(s, dtype=torch.long), 0, torch.qint8)
    x = torch.randn(3, w.shape[1])
    got = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(qw, None), True)
    want = F.linear(x, qw.dequantize())
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize("kw, word", [({"rows": ()}, "rows"), ({"rows": (0, 2)}, "rows[0]"),
                                      ({"rows": (2,), "tolerance": 0}, "tolerance"),
                                      ({"rows": (2,), "tolerance": -0.1}, "tolerance"),
                                      ({"rows": (2,), "context": 0}, "context"),
                                      ({"rows": (2,), "rounds": 0}, "rounds")])
def test_bad_input_names_the_argument(model, kw, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        verify_table(model, hardware=HW, **kw)


def test_plot_draws_the_table():
    pytest.importorskip("matplotlib")
    from minillm.viz.roofline import plot_verify_cost
    rows = [{"n": n, "ratio": r, "least": l, "roofline": 1.0, "int8_least": l}
            for n, r, l in ((1, 1.0, 1.0), (8, 1.6, 1.4), (64, 4.0, 3.0))]
    fig = plot_verify_cost({"rows": rows, "tolerance": 0.15, "ridge_rows": 40, "context": 128})
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].lines}
    assert lines["measured forward(N) / forward(1)"] == [1.0, 1.6, 4.0]
    assert lines["least these matmul kernels allow"] == [1.0, 1.4, 3.0]
    assert "ridge: 40 rows" in lines
