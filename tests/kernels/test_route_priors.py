"""The untimed guess a busy first start takes (minillm/kernels/route_priors.py): it is what the
committed records say (rebuilt from them here, so neither can drift), it is looked up from the
closest CPU, and a guess that fits no CPU is F.linear. Every route computes x @ W^T: whatever the
guess, the model's logits are the reference's."""
import json

import pytest
import torch

import minillm
from benchmarks.route_priors import PRIORS_FILE, build
from minillm.kernels import cpu_tuning as ct
from minillm.kernels import route_priors as rp
from minillm.lab.common import load_results


def test_the_committed_priors_are_what_the_records_say():
    assert json.loads(PRIORS_FILE.read_text()) == build(load_results())
    assert rp.load_priors(), "the package reads its priors"


def _rec(cpu, threads, plan=None, decode=None, isa=None):
    key = {"cpu": cpu, "threads": threads, **({"isa": {"aten": isa}} if isa else {})}
    rec = {"benchmark": "kernels", "machine": {"device": "cpu", "cpu": cpu, "torch_threads": threads,
                                               "date": "d"}}
    if plan:
        rec["kernels"] = {"key": key, "source": "tuned", "plan": plan}
    if decode:
        rec["decode_ms_per_token"] = decode
    return rec


def _plan(layout, routes):
    return {"layout": layout, "routes": {str(b): r for b, r in zip(ct.BUCKETS, routes)}}


def test_build_votes_per_bucket_and_keeps_one_layout():
    n = len(ct.BUCKETS)
    recs = [_rec("AMD EPYC 9R14", 2, isa="AVX512", plan={
        "a": _plan("in_out", ["ksplit"] * 2 + ["onednn_io"] * (n - 2)),
        "b": _plan("in_out", ["x@W"] * n),
        "c": _plan("in_out", ["ksplit"] * n)}),
        _rec("Intel Xeon", 1, decode={"F.linear": 48.0, "x@W": 30.4, "prepacked": 20.0, "transformers": 9.0})]
    priors = build(recs)["priors"]
    amd, intel = priors
    assert (amd["vendor"], amd["isa"], amd["threads"], amd["layout"]) == ("AMD", "AVX512", "many", "in_out")
    assert amd["routes"]["1"] == amd["routes"]["2"] == "ksplit"        # 2 votes of 3
    assert amd["routes"]["256"] == "ksplit"       # a three-way tie: the first name, so the file is stable
    # decode times only: the fastest single-copy route (not prepacked, not a peer) at one row,
    # and the buckets above it take the same
    assert (intel["vendor"], intel["threads"], intel["layout"]) == ("Intel", "1", "in_out")
    assert set(intel["routes"].values()) == {"x@W"}


PRIORS = [{"vendor": "AMD", "isa": "AVX512", "threads": "many", "layout": "in_out",
           "routes": {str(b): "ksplit" for b in ct.BUCKETS}},
          {"vendor": "AMD", "isa": None, "threads": "1", "layout": "in_out",
           "routes": {str(b): "x@W" for b in ct.BUCKETS}},
          {"vendor": "Intel", "isa": None, "threads": "many", "layout": "out_in",
           "routes": {str(b): "onednn" for b in ct.BUCKETS}}]


@pytest.mark.parametrize("vendor,isa,threads,want", [
    ("AMD", "AVX512", 2, 0),          # exact
    ("AMD", "AVX2", 1, 1),            # same vendor and thread class
    ("AMD", "AVX2", 4, 0),            # same vendor
    ("Intel", "AMX", 1, 2),
    ("arm", "DEFAULT", 1, None)])
def test_the_closest_prior_is_found(vendor, isa, threads, want):
    got = rp.find_prior(vendor, isa, threads, PRIORS)
    assert got is (None if want is None else PRIORS[want])


def test_vendor_names():
    assert rp.vendor_of("AuthenticAMD") == "AMD" and rp.vendor_of("GenuineIntel") == "Intel"
    assert rp.vendor_of("AMD EPYC") == "AMD" and rp.vendor_of("Intel(R) Xeon(R) Processor") == "Intel"
    assert rp.vendor_of("arm64") == "arm" and rp.vendor_of("aarch64") == "arm"


def test_no_prior_is_f_linear_and_a_route_off_its_layout_is_not_taken(monkeypatch):
    plan, why = rp.prior_plan(2, priors=[])
    assert set(plan["routes"].values()) == {"F.linear"} and "F.linear" in why
    monkeypatch.setattr(rp, "cpu_vendor", lambda: "AMD")
    odd = [{**PRIORS[0], "routes": {**PRIORS[0]["routes"], "1": "onednn"}}]   # onednn is out_in
    plan, _ = rp.prior_plan(2, priors=odd)
    assert plan["layout"] == "in_out" and plan["routes"][1] == "F.linear" and plan["routes"][2] == "ksplit"


def test_on_one_thread_a_split_route_is_named_for_what_it_runs(monkeypatch):
    monkeypatch.setattr(rp, "cpu_vendor", lambda: "AMD")
    monkeypatch.setattr(rp, "kernel_isa", lambda: {"aten": "AVX512"})
    plan, why = rp.prior_plan(1, priors=PRIORS[:1])           # the several-threads entry: ksplit
    assert set(plan["routes"].values()) == {"x@W"} and "(x@W)" in why
    assert set(rp.prior_plan(2, priors=PRIORS[:1])[0]["routes"].values()) == {"ksplit"}


@pytest.mark.parametrize("entry", PRIORS)
def test_any_prior_gives_the_reference_logits(monkeypatch, entry):
    monkeypatch.setattr(ct, "prior_plan", lambda threads: rp.prior_plan(threads, priors=[entry]))
    monkeypatch.setattr(rp, "cpu_vendor", lambda: entry["vendor"])
    monkeypatch.setattr(ct, "load_now", lambda **k: type("Busy", (), {"busy": lambda s, t: True,
                                                                       "describe": lambda s: "busy"})())
    monkeypatch.setattr(ct, "_QUICK", {})
    model = ct.accelerate(minillm.tiny_model())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), minillm.tiny_model()(ids), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(ids[:, :1]), minillm.tiny_model()(ids[:, :1]), atol=1e-5, rtol=1e-5)
