"""Chapter 11's extrapolation: roofline step costs for a tensor-parallel instance, DistServe's
max-rate search, the prefill:decode split of a 70B deployment and the scaling book's ratio."""
import pytest

from minillm.analysis.disagg_scale import (best_split, max_rate, roofline_step_costs,
                                           scaling_book_ratio)
from minillm.analysis.parallel_math import Link, tp_comm_time
from minillm.analysis.kv_math import weight_bytes
from minillm.analysis.roofline import decode_costs, get_hardware, prefill_costs, step_time
from minillm.model.config import get_config

CFG, H100 = get_config("llama-3-70b"), get_hardware("h100-sxm")
FREE = Link("free", 1e30, 0.0)         # a link that costs nothing


def test_scaling_book_worked_example():
    # 32 requests every 512 * 19 ms on a decode server; a prefill server takes 910 ms each
    assert scaling_book_ratio() == pytest.approx(32 / (512 * 0.019) * 0.91)
    assert round(scaling_book_ratio()) == 3


def test_roofline_costs_fit_the_roofline():
    costs = roofline_step_costs(CFG, H100, tp=1, link=FREE)
    for n in (512, 4096):
        want = step_time(prefill_costs(CFG, n), H100, "bf16")
        assert costs.prefill_seconds([n]) == pytest.approx(want, rel=0.05)
    # decode is memory-bound at every batch the fit saw: DistServe's line is exact there
    want = step_time(decode_costs(CFG, 32, 2048), H100, "bf16")
    assert costs.decode_seconds([2048] * 32) == pytest.approx(want, rel=1e-6)
    # a decode step's fixed cost is about one read of the weights
    assert costs.decode_a == pytest.approx(weight_bytes(CFG) / H100.mem_bandwidth, rel=0.1)


def test_tensor_parallel_costs_split_the_work_and_add_the_all_reduces():
    one = roofline_step_costs(CFG, H100, tp=1, link=FREE)
    free = roofline_step_costs(CFG, H100, tp=8, link=FREE)
    assert free.prefill_seconds([2048]) == pytest.approx(one.prefill_seconds([2048]) / 8, rel=1e-6)
    assert free.decode_seconds([512]) == pytest.approx(one.decode_seconds([512]) / 8, rel=1e-6)
    # Megatron's collectives over NVLink: bytes in prefill, latency in decode
    nvlink = roofline_step_costs(CFG, H100, tp=8)
    extra = tp_comm_time(CFG, 8, 2048, "nvlink4", 2, num_logit_rows=1)
    assert nvlink.prefill_seconds([2048]) == pytest.approx(free.prefill_seconds([2048]) + extra, rel=0.05)
    extra = tp_comm_time(CFG, 8, 1, "nvlink4", 2, num_logit_rows=1)
    assert nvlink.decode_seconds([512]) == pytest.approx(free.decode_seconds([512]) + extra, rel=1e-3)


def test_max_rate_finds_the_threshold():
    def run(rate):      # every request meets the SLO up to 3.3 req/s, none above
        ok = rate <= 3.3
        return [{"ttft": 0.1 if ok else 9.0, "itls": [0.01]}] * 10
    got = max_rate(run, ttft_s=1.0, itl_s=0.1, rel_tol=0.01)
    assert 3.3 * 0.99 <= got <= 3.3
    assert max_rate(lambda r: [{"ttft": 9.0, "itls": []}], 1.0, 0.1) == 0.0


def test_best_split_of_a_70b_deployment():
    out = best_split(CFG, H100, instances=4, duration_s=8.0)
    assert [(s["prefill"], s["decode"]) for s in out["splits"]] == [(1, 3), (2, 2), (3, 1)]
    assert out["best"]["max_rate"] == max(s["max_rate"] for s in out["splits"]) > 0
    # long prompts and short answers: prefill is the scarce side, as in the scaling book
    assert out["best"]["prefill"] >= out["best"]["decode"]
    # a prompt's prefill stalls every decode of its step: colocated meets the ITL target less
    assert out["colocated"] < out["best"]["max_rate"]


@pytest.mark.parametrize("call, name", [
    (lambda: roofline_step_costs(CFG, H100, tp=0), "tp"),
    (lambda: roofline_step_costs(CFG, H100, efficiency=0.0), "efficiency"),
    (lambda: best_split(CFG, H100, instances=1), "instances"),
    (lambda: scaling_book_ratio(batch=0), "batch"),
    (lambda: max_rate(lambda r: [], 1.0, 0.1, attainment=1.5), "attainment"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_wrong_types_are_refused():
    with pytest.raises(TypeError, match="chip"):
        roofline_step_costs(CFG, "h100")
    with pytest.raises(TypeError, match="cfg"):
        roofline_step_costs("llama", H100)
