"""The tuned CPU matmul routes (minillm.kernels: cpu_kernels, route_timing, cpu_tuning).

Every route is checked against the product in float64 on both weight layouts; the tuning cache
against corrupt, foreign and unwritable folders; accelerated models against the plain model.
Nothing here depends on which route is fastest on the machine that runs it: the machine's load
is faked (a quiet one unless a test says otherwise), and so is the clock where timing decides.
The first-start path (no table: a quick probe, one line) and the noise rules (a busy machine's
table is saved marked and not used) are in tests/kernels/test_kernel_tuning.py.
"""
import json

import pytest
import torch
import torch.nn as nn

import minillm
from minillm.kernels import cpu_kernels as ck
from minillm.kernels import cpu_tuning as ct
from minillm.kernels import route_timing as rt
from fake_load import fake_load

ROUTES = [r for r in ck.ROUTES if r != "auto"]


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """A machine with nothing else running (its CPU counters, and rounds that never count as noise: the
    real rounds on a shared test machine may not settle), and no quick probe remembered."""
    fake_load(monkeypatch, others=0.0, cores=64)
    monkeypatch.setattr(ct, "UNSETTLED_OK", 1.0)
    monkeypatch.setattr(ct, "_QUICK", {})


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_every_route_matches_float64(rows, layout, n_threads, threads):
    threads(n_threads)
    torch.manual_seed(rows)
    lin = nn.Linear(48, 96, bias=False)
    ck.relayout(lin.weight, layout)
    lin.__class__ = ck.RoutedLinear
    for lead in [(), (1,), (2,)]:
        x = torch.randn(*lead, rows, 48)
        ref = x.double() @ lin.weight.double().t()
        for route in ROUTES:
            with torch.inference_mode(), ck.linear_route(route):
                out = lin(x)
            assert out.shape == (*lead, rows, 96), route
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=route)


def test_relayout_keeps_the_values_and_stores_once():
    lin = nn.Linear(8, 12, bias=False)
    before = lin.weight.detach().clone()
    ck.relayout(lin.weight, "in_out")
    assert lin.weight.stride() == (1, 12) and lin.weight.t().is_contiguous()
    assert lin.weight.untyped_storage().nbytes() == 8 * 12 * 4           # one copy, not two
    assert torch.equal(lin.weight, before)
    ck.relayout(lin.weight, "out_in")
    assert lin.weight.is_contiguous() and torch.equal(lin.weight, before)


def test_model_is_built_from_plain_linear():
    model = minillm.Transformer(minillm.tiny_model().config)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == {nn.Linear}


def test_accelerate_agrees_with_the_plain_model_and_plain_undoes_it(tmp_path):
    model = minillm.tiny_model(tie_embeddings=True)
    x = torch.randint(0, 256, (2, 7))
    with torch.inference_mode():
        ref = model(x)
    keys = list(model.state_dict())
    ct.accelerate(model, cache_dir=tmp_path)
    assert all(type(m) is ck.RoutedLinear for m in model.modules() if isinstance(m, nn.Linear))
    assert model.lm_head.weight is model.embed.weight                    # still tied
    assert list(model.state_dict()) == keys
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
        again = model(x)
        assert torch.equal(model(x), again)                              # no flicker within a run
    report = ct.kernel_report(model)
    assert report["extra_bytes"] == 0 and set(report["plan"]) == set(ct.linears(model))
    ct.plain(model)
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
    assert all(p.is_contiguous() for p in model.parameters())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, atol=1e-6, rtol=1e-6)


def test_pinned_route_is_exactly_that_route(tmp_path):
    model = minillm.tiny_model()
    x = torch.randint(0, 256, (1, 5))
    with torch.inference_mode():
        ref = model(x)                                                   # plain: F.linear
    ct.accelerate(model, route="F.linear")
    with torch.inference_mode():
        assert torch.equal(model(x), ref)
    assert all(set(p["routes"].values()) == {"F.linear"} for p in model.linear_plan.values())


def test_tuning_is_cached_and_reused(tmp_path, monkeypatch):
    model = minillm.tiny_model()
    first = ct.tune(model, cache_dir=tmp_path, rounds=1)
    files = list(tmp_path.glob("linear_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == ct.cache_key()

    def no_timing(*a, **k):
        raise AssertionError("timed again although the cache holds the table")
    monkeypatch.setattr(ct, "race", no_timing)
    monkeypatch.setattr(ct, "_time_shape", no_timing)
    assert ct.tune(model, cache_dir=tmp_path) == first
    ct.accelerate(model, cache_dir=tmp_path)                             # reads, never times
    assert model.linear_plan_source == "tuned"


def test_a_table_timed_with_one_instruction_set_is_not_reused_under_another(tmp_path, monkeypatch):
    # the same CPU held to AVX2 through oneDNN's documented switch runs other kernels: its own table
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    model = minillm.tiny_model()
    ct.tune(model, cache_dir=tmp_path, rounds=1)
    plain_key = ct.cache_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert ct.cache_key()["isa"]["ONEDNN_MAX_CPU_ISA"] == "AVX2" and ct.cache_key() != plain_key
    timed = []
    real = ct._time_shape
    monkeypatch.setattr(ct, "_time_shape", lambda *a, **k: timed.append(1) or real(*a, **k))
    ct.tune(model, cache_dir=tmp_path, rounds=1)
    assert timed, "the table timed without the switch was reused"
    assert len(list(tmp_path.glob("linear_*.json"))) == 2          # both tables kept, side by side


@pytest.mark.parametrize("content", ["{not json", "[]", '{"key": {"cpu": "another CPU"}, "shapes": {}}',
                                     '{"key": null, "shapes": 3}'])
def test_corrupt_or_foreign_cache_is_retuned(tmp_path, content):
    model = minillm.tiny_model()
    path = ct.cache_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    times = ct.tune(model, cache_dir=tmp_path, rounds=1)
    assert set(times) == set(ct.linears(model))
    assert json.loads(path.read_text())["key"] == ct.cache_key()        # rewritten, ours now


def test_unwritable_cache_folder_still_tunes(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model = minillm.tiny_model()
    x = torch.randint(0, 256, (1, 4))
    with torch.inference_mode():
        ref = model(x)
    ct.accelerate(model, cache_dir=blocker / "kernels")                 # mkdir fails under a file
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)


def test_bad_route_names_are_rejected():
    with pytest.raises(ValueError, match="route must be one of"):
        with ck.linear_route("fast"):
            pass
    with pytest.raises(ValueError, match="route must be one of"):
        ct.accelerate(minillm.tiny_model(), route="mkl")
    with pytest.raises(ValueError, match="kernels must be"):
        minillm.load_model(kernels="fastest")


def test_decide_is_a_pure_function_of_the_timings():
    times = {"F.linear": {"1": 10.0, "8": 20.0}, "nsplit": {"1": 6.0, "8": 30.0},
             "x@W": {"1": 5.0, "8": 19.0}, "ksplit": {"1": 4.0, "8": 25.0},
             "prepacked": {"1": 9.0, "8": 5.0}}
    plan = ct.decide(times)
    assert plan == {"layout": "in_out", "routes": {1: "ksplit", 8: "x@W"}}
    assert ct.decide(times, allow_copies=True)["routes"] == {1: "ksplit", 8: "prepacked"}
    assert ct.decide({"F.linear": {"1": 1.0}}) == {"layout": "out_in", "routes": {1: "F.linear"}}
    assert ct.decide({}) == {"layout": "out_in", "routes": {}}


def test_other_dtypes_and_autograd_keep_f_linear(tmp_path):
    model = minillm.tiny_model(dtype=torch.bfloat16)
    ct.accelerate(model, cache_dir=tmp_path)
    assert not hasattr(model, "linear_plan")                            # nothing to route
    lin = nn.Linear(48, 96, bias=False)
    lin.__class__ = ck.RoutedLinear
    lin.routes = {b: "ksplit" for b in ck.BUCKETS}
    x = torch.randn(9, 48)
    lin(x).sum().backward()                                             # grad enabled: F.linear
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(96, 48))


@pytest.mark.skipif(not ck.PREPACK_OK, reason="this torch has no oneDNN linear")
def test_packed_copy_follows_weight_changes():
    """A stale packed copy would silently compute with old weights."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 96, bias=False)
    lin.__class__ = ck.RoutedLinear
    x = torch.randn(9, 48)

    def packed_out():
        with torch.inference_mode(), ck.linear_route("prepacked"):
            y = lin(x)
        assert lin.extra_bytes() > 0                                    # the route was taken
        return y

    torch.testing.assert_close(packed_out(), x @ lin.weight.detach().t())
    with torch.no_grad():
        lin.weight.mul_(-2.0)                                           # in place: new version
    torch.testing.assert_close(packed_out(), x @ lin.weight.detach().t())
    lin.weight = nn.Parameter(torch.randn(96, 48))                      # a new tensor
    torch.testing.assert_close(packed_out(), x @ lin.weight.detach().t())


def test_skinny_route_names_still_work():
    assert "F.linear" in ck.ROUTES and "prepacked" in ck.ROUTES and "skinny" in ck.ROUTES
    lin = ck.RoutedLinear(16, 8, bias=False)
    x = torch.randn(3, 16)
    for ctx in (ck.linear_route("skinny"), ck.skinny_route(True), ck.skinny_route(False)):
        with torch.inference_mode(), ctx:
            torch.testing.assert_close(lin(x), x @ lin.weight.detach().t())


def test_tuning_rounds_go_on_until_the_fastest_two_agree(monkeypatch):
    """A disturbed round (another process on the machine) must not decide the table: the rounds
    go on until each case's two fastest samples agree, up to max_rounds."""
    assert rt.settled([10.0, 10.5, 30.0]) and not rt.settled([10.0, 30.0]) and not rt.settled([1.0])
    now = [0.0]
    script = iter([50.0, 9.0, 40.0, 9.5] + [100.0] * 50)       # ms per pass, round by round

    def fake_matmul(*args, **kwargs):
        now[0] += next(script)

    monkeypatch.setattr(rt, "matmul", fake_matmul)
    monkeypatch.setattr(rt, "_works", lambda *a: True)
    monkeypatch.setattr(rt.time, "perf_counter", lambda: now[0] / 1e3)
    w = [torch.zeros(4, 3)]
    out = rt.time_rows(w, [1], rounds=2, candidates=("F.linear",), max_rounds=6)
    assert out["F.linear"][1] == pytest.approx(9.0)              # stopped after round 4: 9.0, 9.5
    assert next(script) == 100.0                                # ... and took no 5th sample
    script = iter([50.0, 9.0, 40.0, 20.0, 30.0, 60.0, 1.0])     # never settles within 6 rounds
    out = rt.time_rows(w, [1], rounds=2, candidates=("F.linear",), max_rounds=6)
    assert out["F.linear"][1] == pytest.approx(9.0) and next(script) == 1.0


def test_tuning_drops_clear_losers_and_times_a_quarter_at_many_rows(monkeypatch):
    """After the first rounds a route over PRUNE x the best stops being timed (its best time so
    far is kept), and from SUBSET_ROWS rows on a quarter of the group's weights is timed, scaled
    to the whole group: a fake clock where each call costs a fixed time per route."""
    now, calls = [0.0], []
    slower = iter(range(1, 1000))                # F.linear: each call slower, so it never settles
    cost = {"F.linear": lambda: float(next(slower)), "x@W": lambda: 100.0}

    def fake_matmul(x, w, route, *args, **kwargs):
        calls.append((route, x.shape[0]))
        now[0] += cost[route]()

    monkeypatch.setattr(rt, "matmul", fake_matmul)
    monkeypatch.setattr(rt, "_works", lambda *a: True)
    monkeypatch.setattr(rt.time, "perf_counter", lambda: now[0] / 1e3)
    weights = [torch.zeros(4, 3)] * 8
    out = rt.time_rows(weights, [1, rt.SUBSET_ROWS], rounds=2, candidates=("F.linear", "x@W"),
                       max_rounds=5)
    # x@W: 8 calls of 100 ms per pass at 1 row, 2 calls (a quarter) scaled x4 at SUBSET_ROWS rows
    assert out["x@W"] == {1: pytest.approx(800.0), rt.SUBSET_ROWS: pytest.approx(800.0)}
    assert out["F.linear"] == {1: pytest.approx(sum(range(1, 9))), rt.SUBSET_ROWS: pytest.approx(4 * (9 + 10))}
    assert calls.count(("x@W", 1)) == 2 * 8 and calls.count(("x@W", rt.SUBSET_ROWS)) == 2 * 2
    assert calls.count(("F.linear", 1)) == 5 * 8                 # still racing: all 5 rounds
    assert calls.count(("F.linear", rt.SUBSET_ROWS)) == 5 * 2


def test_a_much_faster_copy_does_not_end_the_race_among_single_copy_routes(monkeypatch):
    """"prepacked" (a second copy, not chosen by default) is never the yardstick for pruning:
    F.linear and x@W, both over 1.5x slower than it but close to each other, keep racing."""
    now, calls = [0.0], []
    slower = iter(range(1, 1000))                      # F.linear never settles
    cost = {"prepacked": lambda: 1.0, "F.linear": lambda: 10.0 + 5 * next(slower),
            "x@W": lambda: 12.0}

    def fake_matmul(x, w, route, *args, **kwargs):
        calls.append(route)
        now[0] += cost[route]()

    monkeypatch.setattr(rt, "matmul", fake_matmul)
    monkeypatch.setattr(rt, "_works", lambda *a: True)
    monkeypatch.setattr(rt, "pack", lambda w: w)
    monkeypatch.setattr(rt, "PREPACK_OK", True)
    monkeypatch.setattr(rt.time, "perf_counter", lambda: now[0] / 1e3)
    rt.time_rows([torch.zeros(4, 3)], [1], rounds=2, candidates=("F.linear", "x@W", "prepacked"),
                 max_rounds=5)
    assert calls.count("x@W") == 5 and calls.count("prepacked") == 5
