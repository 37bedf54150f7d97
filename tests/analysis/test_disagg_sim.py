"""Chapter 11's simulator: DistServe's step-cost fit, SLO attainment and goodput, and the event
simulator of colocated and disaggregated serving. References: known coefficients for the fit,
timelines worked out by hand, the engine's own scheduler for which tokens each step holds, and
the load generator's arrival times."""
import math

import pytest
import torch

from minillm.analysis.disagg_sim import (SimConfig, SimRequest, kv_transfer_time, poisson_arrivals,
                                         simulate_colocated, simulate_disaggregated)
from minillm.analysis.parallel_math import Link, get_link
from minillm.analysis.slo import goodput, latency_percentiles, slo_attainment, summarize
from minillm.analysis.step_fit import StepCosts, fit_error, fit_step_costs
from minillm.model.config import get_config

KNOWN = StepCosts(0.02, 3e-4, 2e-7, 0.015, 4e-6, 1e-3)
UNIT = StepCosts(1.0, 0.01, 0.0, 0.5, 0.0, 0.0)     # prefill 1 + L/100 s, decode 0.5 s


def synthetic_samples(costs: StepCosts):
    pre = [([n], costs.prefill_seconds([n])) for n in (16, 64, 200, 512)] + \
          [([30, 90], costs.prefill_seconds([30, 90]))]
    dec = [([s] * b, costs.decode_seconds([s] * b)) for b in (1, 4, 16) for s in (32, 400)]
    return pre, dec


def test_fit_recovers_known_coefficients():
    pre, dec = synthetic_samples(KNOWN)
    fit = fit_step_costs(pre, dec)
    for name in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"):
        assert getattr(fit, name) == pytest.approx(getattr(KNOWN, name), rel=1e-9), name
    err = fit_error(fit, pre, dec)
    assert err["prefill"]["max"] < 1e-9 and err["decode"]["max"] < 1e-9


def test_fit_keeps_every_term_a_cost():
    # times that fall with the prompt length would need b < 0: that term is dropped instead
    pre = [([n], 2.0 - 0.001 * n) for n in (10, 100, 500, 900)]
    dec = [([s] * b, 0.5) for s in (1, 100) for b in (1, 3)]
    fit = fit_step_costs(pre, dec)
    assert fit.prefill_b == 0.0 and fit.decode_a == pytest.approx(0.5)
    assert min(fit.prefill_a, fit.prefill_c, fit.decode_b, fit.decode_c) >= 0


def test_mixed_step_pays_one_fixed_cost_and_chunks_see_their_cache():
    c = KNOWN
    chunk = c.prefill_b * 64 + c.prefill_c * 64 * (100 + 64)        # 64 tokens after 100 cached
    dec = c.decode_b * (50 + 70) + c.decode_c * 2
    assert c.step_seconds([(64, 100)], [50, 70]) == pytest.approx(max(c.prefill_a, c.decode_a) + chunk + dec)
    assert c.step_seconds() == 0.0
    assert c.prefill_seconds([64], [100]) == pytest.approx(c.prefill_a + chunk)


def test_one_request_colocated_by_hand():
    (r,) = simulate_colocated([SimRequest(0.0, 100, 3)], UNIT)
    assert r.token_times == pytest.approx([2.0, 2.5, 3.0])     # prefill 1 + 1, then 0.5 a decode
    assert r.ttft == pytest.approx(2.0) and r.itls == pytest.approx([0.5, 0.5])


def test_a_prompt_stalls_the_decodes_of_its_step():
    # r0's second token shares a step with r1's 50-token prefill: 1 + 0.5 s instead of 0.5
    r0, r1 = simulate_colocated([SimRequest(0.0, 100, 3), SimRequest(0.2, 50, 2)], UNIT)
    assert r0.token_times == pytest.approx([2.0, 3.5, 4.0])
    assert r1.token_times == pytest.approx([3.5, 4.0]) and r1.ttft == pytest.approx(3.3)


def test_chunked_prefill_by_hand():
    costs = StepCosts(1.0, 0.01, 1e-4, 0.5, 0.0, 0.0)
    cfg = SimConfig(max_num_batched_tokens=64, max_num_seqs=4, long_prefill_token_threshold=0,
                    max_num_partial_prefills=1)
    (r,) = simulate_colocated([SimRequest(0.0, 100, 2)], costs, cfg)
    first = 1 + 0.64 + 1e-4 * 64 * 64
    second = 1 + 0.36 + 1e-4 * 36 * (64 + 36)
    assert r.token_times == pytest.approx([first + second, first + second + 0.5])


def test_disaggregated_by_hand():
    reqs = [SimRequest(0.0, 100, 3), SimRequest(0.2, 50, 2)]
    r0, r1 = simulate_disaggregated(reqs, UNIT, UNIT, transfer_s=0.1)
    assert r0.token_times == pytest.approx([2.0, 2.6, 3.1])    # transfer 2.0 -> 2.1, then decodes
    assert r0.transfer_done_s == pytest.approx(2.1)
    assert r1.token_times == pytest.approx([3.5, 4.1])         # prefill 2.0 -> 3.5, transfer, decode
    # the prefill engine that sends the KV itself starts r1 only after r0's transfer
    r0, r1 = simulate_disaggregated(reqs, UNIT, UNIT, transfer_s=0.1, transfer_blocks_prefill=True)
    assert r1.token_times == pytest.approx([3.6, 4.2])
    # a transfer that depends on the prompt: 1 ms a token
    r0, _ = simulate_disaggregated(reqs, UNIT, UNIT, transfer_s=lambda n: 1e-3 * n)
    assert r0.transfer_done_s == pytest.approx(2.1)


def test_colocated_itl_shows_the_prefill_stall_disaggregated_does_not():
    costs = StepCosts(0.01, 1e-4, 0.0, 0.01, 0.0, 0.0)
    chats = [SimRequest(0.05 * i, 20, 40) for i in range(4)]
    long = SimRequest(0.3, 500, 2)                              # 500 tokens: 10 ms + 50 ms
    colo = simulate_colocated(chats + [long], costs)
    disagg = simulate_disaggregated(chats + [long], costs, costs, transfer_s=0.001)
    worst = lambda rs: max(g for r in rs[:4] for g in r.itls[1:])    # noqa: E731
    assert worst(colo) >= 0.01 + 1e-4 * 384 - 1e-9              # a 384-token chunk rides a step
    assert worst(disagg) == pytest.approx(0.01)                   # decode steps only
    # the first gap holds the transfer and the wait for the decode engine's running step
    assert all(r.itls[0] <= 0.001 + 2 * 0.01 + 1e-9 for r in disagg[:4])


@pytest.fixture(scope="module")
def tiny_engine_factory():
    from minillm.engine.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    from minillm.model.loading import tiny_model
    model = tiny_model(vocab_size=64, seed=0)

    def make(cfg: SimConfig):
        return LLMEngine(model, EngineConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            max_num_partial_prefills=cfg.max_num_partial_prefills,
            max_long_partial_prefills=cfg.max_long_partial_prefills, num_blocks=256, block_size=4,
            attention_backend="paged"))
    return make


@pytest.mark.parametrize("case", range(8))
def test_steps_hold_what_the_engines_scheduler_puts_in_them(case, tiny_engine_factory, one_thread):
    from minillm.engine.sampling_params import SamplingParams
    g = torch.Generator().manual_seed(case)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))   # noqa: E731
    n = pick(2, 7)
    prompts, outs = [pick(2, 60) for _ in range(n)], [pick(1, 8) for _ in range(n)]
    budget = (16, 24, 32, 64)[pick(0, 3)]
    thr = (0, 8, 12, 20)[pick(0, 3)]
    parts = pick(1, 3) if thr else 1
    cfg = SimConfig(budget, pick(1, 6), thr, parts, pick(1, parts))
    engine = tiny_engine_factory(cfg)
    for p, o in zip(prompts, outs):
        engine.add_request(list(range(1, p + 1)), SamplingParams(max_tokens=o, ignore_eos=True),
                           arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    trace = []
    simulate_colocated([SimRequest(0.0, p, o) for p, o in zip(prompts, outs)],
                       StepCosts(1, 0, 0, 1, 0, 0), cfg, trace=trace)
    key = lambda r: (r["num_prefill_tokens"], r["num_decode_tokens"])   # noqa: E731
    assert [key(r) for r in trace] == [key(r) for r in engine.trace]


def test_arrivals_are_the_load_generators():
    from minillm.lab.serve_client import arrival_times
    assert poisson_arrivals(2.5, 20, seed=3) == arrival_times(20, 2.5, 1.0, seed=3)


def test_kv_transfer_time_smollm2():
    cfg = get_config("smollm2-135m")          # 23,040 B a token in bf16 (chapter 2)
    assert kv_transfer_time(cfg, 1000, 1.25e9) == pytest.approx(23_040_000 / 1.25e9)
    link = Link("test", 1e9, 1e-3)
    assert kv_transfer_time(cfg, 10, link, dtype="fp32") == pytest.approx(1e-3 + 460_800 / 1e9)
    ten = get_link("10gbe")     # the anchors' figure: a 1k-token prompt, ~18 ms over 10 GbE
    assert kv_transfer_time(cfg, 1000, "10gbe") == pytest.approx(ten.latency_s + 23_040_000 / 1.25e9)


def test_attainment_and_goodput_by_hand():
    results = [{"ttft": 0.1, "itls": [0.02, 0.04]},     # TPOT 0.03: meets both
               {"ttft": 0.5, "itls": [0.01]},           # TTFT too slow
               {"ttft": 0.2, "itls": [0.05, 0.07]},     # TPOT 0.06 too slow
               {"ttft": 0.3, "itls": []}]               # one token: no gaps, meets TPOT
    assert slo_attainment(results, ttft_s=0.3, itl_s=0.05) == 0.5
    assert goodput(results, 0.3, 0.05, duration_s=4.0) == 0.5
    s = summarize(results, 0.3, 0.05, 4.0)
    assert s["throughput"] == 1.0 and s["ttft_ms"]["p50"] == pytest.approx(250.0)


def test_percentiles_match_torch_quantile():
    values = [0.3, 0.1, 0.9, 0.4, 0.25, 0.6]
    got = latency_percentiles(values, ps=(50, 90, 99))
    want = torch.quantile(torch.tensor(values, dtype=torch.float64), torch.tensor([0.5, 0.9, 0.99],
                          dtype=torch.float64)).tolist()
    assert [got["p50"], got["p90"], got["p99"]] == pytest.approx(want)
    assert math.isnan(latency_percentiles([])["p50"])


@pytest.mark.parametrize("call, name", [
    (lambda: SimRequest(0.0, 0, 4), "prompt_tokens"),
    (lambda: SimRequest(-1.0, 4, 4), "arrival_s"),
    (lambda: poisson_arrivals(0.0, 4), "rate"),
    (lambda: simulate_colocated([], UNIT), "requests"),
    (lambda: simulate_colocated([SimRequest(0, 4, 4)], UNIT, instances=0), "instances"),
    (lambda: simulate_disaggregated([SimRequest(0, 4, 4)], UNIT, UNIT, transfer_s=-1), "transfer_s"),
    (lambda: SimConfig(max_num_batched_tokens=8, max_num_seqs=16), "max_num_seqs"),
    (lambda: StepCosts(-1, 0, 0, 0, 0, 0), "prefill_a"),
    (lambda: fit_step_costs([([4], 1.0)] * 2, [([4], 1.0)] * 3), "prefill_samples"),
    (lambda: UNIT.decode_seconds([]), "contexts"),
    (lambda: slo_attainment([{"ttft": 1, "itls": []}], 0, 1), "ttft_s"),
    (lambda: goodput([], 1, 1, duration_s=0), "duration_s"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_wrong_types_are_refused():
    with pytest.raises(TypeError, match="costs"):
        simulate_colocated([SimRequest(0, 4, 4)], costs={"a": 1})
    with pytest.raises(TypeError, match="requests"):
        simulate_colocated([(0, 4, 4)], UNIT)
    with pytest.raises(TypeError, match="link"):
        kv_transfer_time(get_config("smollm2-135m"), 10, link=object())
