"""The speedup formula's terms (`lab.drafting_runs.speedup_terms`): hand-computed arithmetic on
a made-up run, and a real run on a tiny model whose counts add up (every step's verify rows are
its drafted tokens plus one; the times split into drafting and verifying within the total)."""
import pytest

import minillm
from minillm.lab.drafting_runs import speedup_terms, time_methods
from minillm.spec.proposers import NgramProposer

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py


def test_terms_by_hand():
    runs = {"plain": {"seconds": 2.0, "tokens": 100, "speedup": 1.0},           # 20 ms a step
            "m": {"seconds": 1.6, "tokens": 100, "steps": 50, "tau": 2.0, "speedup": 1.25,
                  "draft_s": 0.1, "verify_s": 1.4, "verify_rows": [2] * 25 + [4] * 25}}
    costs = {1: 10.0, 2: 12.0, 4: 16.0, 8: 30.0}
    t = speedup_terms(runs, costs)["m"]
    assert t["draft"] == pytest.approx(0.1 / 50 / 0.02)                      # 0.1 plain steps
    assert t["verify"] == pytest.approx((1.2 + 1.6) / 2)                      # mean cost(rows) / cost(1)
    assert t["verify_measured"] == pytest.approx(1.4 / 50 / 0.02)
    assert t["predicted"] == pytest.approx(2.0 / (0.1 + 1.4)) and t["rows"] == 3
    assert t["measured"] == 1.25
    with pytest.raises(ValueError, match="n = 1"):
        speedup_terms(runs, {2: 1.0})


def test_a_real_run_adds_up():
    model = minillm.tiny_model(vocab_size=64, seed=0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]                                 # n-gram has matches
    runs = time_methods(model, [prompt], {"ngram": (NgramProposer(min_ngram=2), None, 3)},
                        max_new_tokens=12, rounds=1)
    r = runs["ngram"]
    assert r["same_as_plain"] and len(r["verify_rows"]) == r["steps"] > 0
    assert 0 <= r["tau"] * r["steps"] - r["tokens"] <= 3   # the last step may be cut at the limit
    assert 0 < r["draft_s"] + r["verify_s"] <= r["seconds"]
    t = speedup_terms(runs, {1: 1.0, 2: 1.5, 4: 2.5})["ngram"]
    assert 1 <= t["rows"] <= 4 and t["verify"] >= 1.0
