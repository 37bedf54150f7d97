"""benchmarks.overhead's op count: a count of ATen ops, so it can be checked without a clock.

Each decoder layer runs the same ops whatever the batch, so the count grows by a fixed number per
layer (measured here as the difference between 2- and 4-layer models) and a decode step of 1 or 8
sequences differs only by the per-step work outside the layers.
"""
from benchmarks.overhead import decoding_engine, ops_per_step, overhead_model, report, run


def test_ops_grow_by_a_fixed_count_per_layer():
    two, four, six = (ops_per_step(overhead_model(n_layer=n), 1)["total"] for n in (2, 4, 6))
    per_layer = (four - two) // 2
    assert four - two == six - four == 2 * per_layer and 20 <= per_layer <= 80
    assert two - 2 * per_layer < 80                       # the step's own ops outside the layers


def test_ops_do_not_grow_with_the_batch():
    model = overhead_model(n_layer=3)
    one, eight = ops_per_step(model, 1), ops_per_step(model, 8)
    assert abs(eight["total"] - one["total"]) < 15        # a mask, not a loop over sequences
    assert sum(one["top"].values()) <= one["total"]


def test_quick_run_reports_every_batch(tmp_path):
    r = run(quick=True, out_dir=tmp_path, threads=1)
    for b in (1, 8, 32):
        row = r[f"batch{b}"]
        assert row["ops_per_step"] > 30 * 20 and row["us_per_op"] > 0
    assert "ATen ops" in report(r) and (tmp_path / "overhead_cpu.json").exists()
