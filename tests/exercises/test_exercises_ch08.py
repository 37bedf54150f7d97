"""Chapter 8's exercise checks accept a right answer written here from the rules and reject wrong ones."""
import json
import math

from minillm import exercises


def test_08_1_littles_law():
    assert exercises.check("08.1", 12)
    assert not exercises.check("08.1", 3 / 4)


def prometheus_quantile(bounds, cumulative, q):
    rank = q * cumulative[-1]
    prev_bound, prev_count = 0.0, 0
    for bound, count in zip(bounds, cumulative):
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def test_08_2_histogram_quantile():
    assert exercises.check("08.2", prometheus_quantile)

    def upper_bound(bounds, cumulative, q):                   # no interpolation
        rank = q * cumulative[-1]
        return next(b for b, c in zip(bounds, cumulative) if c >= rank)
    assert not exercises.check("08.2", upper_bound)


def stream_text(lines):
    texts = {}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


def test_08_3_stream_text():
    assert exercises.check("08.3", stream_text)

    def only_first(lines):                                    # ignores the index
        return {0: "".join(stream_text(lines).values())}
    assert not exercises.check("08.3", only_first)
    assert not exercises.check("08.3", lambda lines: {})


def test_08_4_gamma_gap_spread():
    # one gap: mean 1/4 s, CV 1/sqrt(0.25) = 2, so sd 0.5 s; two independent gaps: variances add
    assert exercises.check("08.4", (2 * 0.5 ** 2) ** 0.5)
    assert not exercises.check("08.4", 2 * 0.5)     # standard deviations added
    assert not exercises.check("08.4", 0.5)         # one gap only


def test_08_5_tpot():
    def tpot_ms(ttft, e2e, n):
        return float("nan") if n < 2 else 1e3 * (e2e - ttft) / (n - 1)
    assert exercises.check("08.5", tpot_ms)
    assert not exercises.check("08.5", lambda ttft, e2e, n: 1e3 * e2e / max(n, 1))


def test_08_6_steps_until_the_reject():
    # arrival at t = 0.03 (after step 0), steps start at 0.03 k: waited 0.03 (k - 1) > 0.2 first at k = 8,
    # which is 7 steps after the arrival step
    assert exercises.check("08.6", 7)
    assert not exercises.check("08.6", math.floor(0.2 / 0.03))    # a wait of exactly 6 steps is not past it


def test_08_7_victim():
    def victim(running):
        key = lambda i: ((0, 0) if running[i]["promoted"] else (1, running[i]["priority"]),
                         running[i]["arrival"])
        return max(range(len(running)), key=key)
    assert exercises.check("08.7", victim)
    assert not exercises.check("08.7", lambda running: max(range(len(running)),
                                                           key=lambda i: running[i]["arrival"]))


def test_08_8_perplexity():
    def perplexity(content):
        return math.exp(-sum(t["logprob"] for t in content) / len(content))
    assert exercises.check("08.8", perplexity)

    def with_alternatives(content):                     # averages over the top_logprobs too
        lps = [a["logprob"] for t in content for a in t["top_logprobs"]]
        return math.exp(-sum(lps) / len(lps))
    assert not exercises.check("08.8", with_alternatives)
    assert not exercises.check("08.8", lambda content: math.exp(-sum(t["logprob"] for t in content)))


def test_08_9_logprob_gap_at_temperature():
    assert exercises.check("08.9", 2.0)
    assert not exercises.check("08.9", 1.0)             # the gap of the raw logits


def test_08_10_choice_renormalized():
    assert exercises.check("08.10", 2 / 3)
    assert not exercises.check("08.10", 0.2)            # the unmasked probability


def test_08_11_decisions_to_the_floor_as_the_controller_moves():
    from types import SimpleNamespace
    from minillm.engine.llm_engine import EngineConfig
    from minillm.engine.policies.slo_controller import SLOController
    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=8, slo_interval_s=1.0, slo_tpot_p95_ms=100)
    ctl = SLOController(cfg, SimpleNamespace(max_num_batched_tokens=512))
    ctl.tick(0.0)
    decisions = 0
    while ctl.budget > 8:                   # TPOT twice the target in every interval
        for i in range(10):
            ctl.record("tpot", decisions + (i + 1) / 11, 0.2)
        decisions += 1
        ctl.tick(float(decisions))
    assert exercises.check("08.11", decisions)
    assert not exercises.check("08.11", decisions - 1)


def test_08_12_tier_blocks_from_the_layout():
    per_block = 2 * 24 * 4 * 96 * 2 * 32          # K and V x layers x heads x dims x fp16 x tokens
    assert exercises.check("08.12", int(0.3 * 2**30) // per_block)
    assert not exercises.check("08.12", int(0.3 * 2**30) // (per_block // 2))  # K or V alone
    assert not exercises.check("08.12", int(0.3 * 2**30) / (per_block / 16))   # tokens, not blocks
    assert not exercises.check("08.12", int(0.3 * 1e9) // per_block)           # GB, not GiB


def test_08_13_recompute_over_restore():
    restore = 2 * 30 * 3 * 64 * 4 * 16 / 8e9
    assert exercises.check("08.13", 16 * 0.27e9 / 50e9 / restore)
    assert not exercises.check("08.13", 0.27e9 / 50e9 / restore)        # one token, not 16
