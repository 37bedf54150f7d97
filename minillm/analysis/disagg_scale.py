"""Chapter 11: the simulator carried to a 70B model on H100s, with step costs from the roofline.

`roofline_step_costs(cfg, chip, tp)` times prefill and decode steps of one instance (a
tensor-parallel group of `tp` chips) with chapter 1's roofline: each op's FLOPs and bytes split
over the chips, at max(FLOPs / peak, bytes / bandwidth) / `efficiency`, plus Megatron's
collectives over the chips' link (`parallel_math.tp_comm_time`, not overlapped with compute).
The step times are fitted by DistServe's formulas (step_fit.py), the same path as the costs
measured here, so the simulator cannot tell them apart. `max_rate(run, ...)` is DistServe's
goodput: the largest Poisson rate at which `attainment` (90%) of requests meet the SLO (doubling,
then bisection). `best_split` tries every prefill:decode split of `instances` against as many
colocated ones; `scaling_book_ratio` is *How to Scale Your Model*'s back-of-envelope for it.

Left out on purpose: pipeline parallelism and different tp for the two phases (DistServe
searches those too), MoE, and memory limits beyond `max_num_seqs`.
"""
import random

from minillm._validate import check_int, check_real
from minillm.analysis.disagg_sim import (SimConfig, SimRequest, kv_transfer_time, poisson_arrivals,
                                         simulate_colocated, simulate_disaggregated)
from minillm.analysis.parallel_math import get_link, tp_comm_time
from minillm.analysis.roofline import Hardware, OpCost, decode_costs, dtype_bytes, prefill_costs
from minillm.analysis.slo import slo_attainment
from minillm.analysis.step_fit import StepCosts, fit_step_costs
from minillm.model.config import ModelConfig


# One instance's chips talk over NVLink 4; instances (prefill to decode) over 400 GbE / IB NDR.
INSTANCE_LINK, KV_LINK = "nvlink4", "400gbe"

# The 70B instance's engine: a prompt prefills whole (vLLM-like budget), up to 256 in a batch.
LARGE_CONFIG = SimConfig(max_num_batched_tokens=8192, max_num_seqs=256,
                         long_prefill_token_threshold=0, max_num_partial_prefills=1)


def _tp_step_seconds(ops: list[OpCost], cfg: ModelConfig, chip: Hardware, tp: int, tokens: int,
                     logit_rows: int, link, dtype, efficiency: float) -> float:
    compute = sum(max(c.flops / tp / chip.peak(dtype), c.bytes / tp / chip.mem_bandwidth)
                  for c in ops) / efficiency
    return compute + tp_comm_time(cfg, tp, tokens, link, dtype_bytes(dtype), logit_rows)


def roofline_step_costs(cfg: ModelConfig, chip: Hardware, tp: int = 8, link=INSTANCE_LINK,
                        dtype="bf16", efficiency: float = 1.0) -> StepCosts:
    """StepCosts of a tp-chip instance, fitted to roofline step times over prompts of 256..8192
    tokens and decode batches of 1..256 at contexts of 256..8192."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(chip, Hardware):
        raise TypeError(f"chip must be a Hardware (roofline.get_hardware), got {type(chip).__name__}")
    check_int("tp", tp, 1)
    check_real("efficiency", efficiency, 0, 1, low_open=True)
    link = get_link(link)
    pre = [([n], _tp_step_seconds(prefill_costs(cfg, n, 1, dtype), cfg, chip, tp, n, 1, link, dtype,
                                  efficiency)) for n in (256, 512, 1024, 2048, 4096, 8192)]
    dec = [([s] * b, _tp_step_seconds(decode_costs(cfg, b, s, dtype), cfg, chip, tp, b, b, link,
                                      dtype, efficiency))
           for b in (1, 8, 32, 128, 256) for s in (256, 2048, 8192)]
    return fit_step_costs(pre, dec)


def fixed_requests(rate: float, n: int, prompt_tokens: int, output_tokens: int, seed: int = 0,
                   spread: float = 0.25) -> list[SimRequest]:
    """n Poisson arrivals with prompt and output lengths uniform within +-spread of the given."""
    check_real("spread", spread, 0, 1, high_open=True)
    rng = random.Random(seed + 1)

    def draw(mean: int) -> int:
        return max(1, round(mean * (1 + spread * (2 * rng.random() - 1))))
    return [SimRequest(t, draw(prompt_tokens), draw(output_tokens))
            for t in poisson_arrivals(rate, n, seed)]


def max_rate(run, ttft_s: float, itl_s: float, attainment: float = 0.9, start: float = 1.0,
             rel_tol: float = 0.03, max_steps: int = 40) -> float:
    """Largest rate with slo_attainment(run(rate), ttft_s, itl_s) >= attainment: double from
    `start` until it fails, then bisect to `rel_tol`. `run(rate)` -> results. 0.0 if even
    start / 2**10 fails."""
    check_real("attainment", attainment, 0, 1, low_open=True)
    check_real("start", start, 0, low_open=True)
    check_real("rel_tol", rel_tol, 0, low_open=True)
    ok = lambda r: slo_attainment(run(r), ttft_s, itl_s) >= attainment  # noqa: E731
    lo, hi = 0.0, start
    for _ in range(max_steps):
        if not ok(hi):
            break
        lo, hi = hi, 2 * hi
    else:
        return lo
    if lo == 0.0:                                   # the start already fails: halve down
        for _ in range(10):
            hi /= 2
            if ok(hi):
                lo, hi = hi, 2 * hi
                break
        else:
            return 0.0
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def best_split(cfg: ModelConfig, chip: Hardware, instances: int = 8, tp: int = 8,
               prompt_tokens: int = 2048, output_tokens: int = 256, ttft_s: float = 0.4,
               itl_s: float = 0.025, attainment: float = 0.9, duration_s: float = 20.0,
               config: SimConfig = LARGE_CONFIG, kv_link=KV_LINK,
               efficiency: float = 1.0, seed: int = 0) -> dict:
    """Max rate (req/s, all instances together) at the SLO for every split P:D of `instances`
    tp-chip instances, and for `instances` colocated ones; each run offers `duration_s` seconds
    of Poisson arrivals (at least 50 requests). -> {"splits": [{prefill, decode, max_rate}],
    "best": the best split, "colocated": max rate, "costs": the StepCosts}."""
    check_int("instances", instances, 2)
    check_real("duration_s", duration_s, 0, low_open=True)
    costs = roofline_step_costs(cfg, chip, tp, efficiency=efficiency)

    def reqs(rate: float) -> list[SimRequest]:
        n = max(50, round(rate * duration_s))
        return fixed_requests(rate, n, prompt_tokens, output_tokens, seed)
    kv_link = get_link(kv_link)
    transfer = lambda n: kv_transfer_time(cfg, n, kv_link)                             # noqa: E731
    start = 1.0
    splits = []
    for p in range(1, instances):
        run = lambda r, p=p: simulate_disaggregated(                                    # noqa: E731
            reqs(r), costs, costs, transfer, config, prefill_instances=p,
            decode_instances=instances - p)
        rate = max_rate(run, ttft_s, itl_s, attainment, start=start)
        splits.append({"prefill": p, "decode": instances - p, "max_rate": round(rate, 3)})
        start = max(rate, 0.5)
    colo = max_rate(lambda r: simulate_colocated(reqs(r), costs, config, instances),
                    ttft_s, itl_s, attainment, start=start)
    return {"splits": splits, "best": max(splits, key=lambda s: s["max_rate"]),
            "colocated": round(colo, 3), "costs": costs}


def scaling_book_ratio(prefill_s: float = 0.91, decode_step_s: float = 0.019, batch: int = 32,
                       output_tokens: int = 512) -> float:
    """Prefill servers per decode server so that neither side waits: a decode server finishes
    `batch` requests every output_tokens * decode_step_s seconds, a prefill server one request
    every prefill_s seconds. Defaults: the scaling book's LLaMA-3-70B example (P ~ 3 G)."""
    check_real("prefill_s", prefill_s, 0, low_open=True)
    check_real("decode_step_s", decode_step_s, 0, low_open=True)
    check_int("batch", batch, 1)
    check_int("output_tokens", output_tokens, 1)
    decode_rate = batch / (output_tokens * decode_step_s)     # requests/s one decode server ends
    return decode_rate * prefill_s                             # / (1 / prefill_s) per prefill server


def split_table(result: dict) -> str:
    """`best_split`'s result as lines: each P:D split's max rate, the colocated one, the best."""
    lines = [f"{'split P:D':>10s} {'max rate (req/s)':>17s}"]
    for s in result["splits"]:
        mark = "  <- best" if s is result["best"] else ""
        lines.append(f"{s['prefill']:>6d}:{s['decode']:<3d} {s['max_rate']:>17.2f}{mark}")
    n = result["splits"][0]["prefill"] + result["splits"][0]["decode"]
    lines.append(f"{'colocated':>10s} {result['colocated']:>17.2f}   ({n} instances)")
    return "\n".join(lines)
