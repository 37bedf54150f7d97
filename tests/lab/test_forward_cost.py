"""minillm.lab.forward_cost and the route timers of minillm.lab.measure: every route timed, the
pinned route restored, and the least forward ratio against numbers worked out by hand. No speed
is asserted."""
import pytest

from minillm.analysis.roofline import Hardware
from minillm.kernels import cpu_kernels
from minillm.kernels.cpu_tuning import CANDIDATES
from minillm.lab.forward_cost import forward_cost, least_forward_ratio
from minillm.lab.measure import skinny_matmul_times
from minillm.model.loading import tiny_model


def test_route_timers_time_every_route_and_restore_the_setting():
    """forward_cost pins routes for a block and skinny_matmul_times times each candidate; the
    pinned route must not outlive the call."""
    cost = forward_cost(tiny_model(), rows=(1, 3), context=8, rounds=1)
    assert set(cost) == {"auto", "F.linear"} and all(set(v) == {"1", "3"} for v in cost.values())
    hw = Hardware("toy", {"fp32": 1e11}, mem_bandwidth=1e10, mem_bytes=1e9)
    t = skinny_matmul_times(hw, 16, 32, rows=(1, 2), repeats=1, min_weight_bytes=4096)
    assert list(t)[0] == "F.linear" and list(t)[-1] == "bound" and set(t) <= {*CANDIDATES, "bound"}
    assert all(len(v) == 2 for v in t.values())
    assert t["bound"][0] == pytest.approx(16 * 32 * 4 / 1e10)
    assert cpu_kernels._PINNED.get() == "auto"


def test_least_forward_ratio_adds_only_the_matmuls_growth_to_one_token():
    cost = {"auto": {"1": 10.0, "9": 20.0, "64": 50.0}, "matmuls": {"1": 6.0, "9": 14.0, "64": 40.0}}
    assert least_forward_ratio(cost) == {"1": 1.0, "9": 1.8, "64": 4.4}
