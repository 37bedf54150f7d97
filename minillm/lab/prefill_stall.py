"""Chapter 11's prefill stall, measured and simulated: short chats decoding when a long prompt
arrives, on one engine (colocated) or on a prefill and a decode engine (disaggregated).

`token_times(engine, shorts, long_prompt)` drives any engine with the serving interface
(`LLMEngine`, `DisaggregatedEngine`): the short prompts start together, the long one is added
once every short request has `inject_after` tokens, and each token's arrival is stamped (seconds
from the start, as the loop sees it). `simulate_token_times(run, layout, costs, ...)` replays the
same arrivals and token counts through analysis/disagg_sim.py. `stall_summary` reads both the
same way: the longest and the median gap between the short requests' tokens once the long prompt
has arrived, and the long prompt's TTFT.

Letters: L prompt tokens. Left out on purpose: HTTP (chapter 8's load generator drives the
servers in `python -m benchmarks disaggregation`), sampling (greedy, `ignore_eos`).
"""
import statistics
import time

from minillm._validate import check_int
from minillm.analysis.disagg_sim import (SimConfig, SimRequest, simulate_colocated,
                                         simulate_disaggregated)
from minillm.engine.config import EngineConfig
from minillm.engine.sampling_params import SamplingParams


def engine_config(sim: SimConfig | None = None) -> EngineConfig:
    """The EngineConfig whose scheduler the simulator's `SimConfig` mirrors."""
    sim = sim or SimConfig()
    return EngineConfig(max_num_batched_tokens=sim.max_num_batched_tokens, max_num_seqs=sim.max_num_seqs,
                        long_prefill_token_threshold=sim.long_prefill_token_threshold,
                        max_num_partial_prefills=sim.max_num_partial_prefills,
                        max_long_partial_prefills=sim.max_long_partial_prefills,
                        enable_chunked_prefill=True)


def token_times(engine, shorts: list[list[int]], long_prompt: list[int], inject_after: int = 4,
                max_tokens: int = 24, long_max_tokens: int = 4) -> dict:
    """-> {"times": {request_id: [s, ...]}, "long_arrival_s", "prompt_tokens": {id: L},
    "max_tokens": {id: n}}; ids "short-0".. and "long"."""
    check_int("inject_after", inject_after, 1, max_tokens - 1)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    t0, times, arrival = time.perf_counter(), {}, None
    lengths = {f"short-{i}": len(p) for i, p in enumerate(shorts)} | {"long": len(long_prompt)}
    for i, p in enumerate(shorts):
        engine.add_request(p, greedy(max_tokens), request_id=f"short-{i}")
    while arrival is None or engine.has_unfinished_requests():
        for out in engine.step():
            now, got = time.perf_counter() - t0, times.setdefault(out.request_id, [])
            got.extend([now] * (len(out.outputs[0].token_ids) - len(got)))
        if arrival is None and all(len(times.get(f"short-{i}", [])) >= inject_after
                                   for i in range(len(shorts))):
            engine.add_request(long_prompt, greedy(long_max_tokens), request_id="long")
            arrival = time.perf_counter() - t0
    return {"times": times, "long_arrival_s": arrival, "prompt_tokens": lengths,
            "max_tokens": {k: long_max_tokens if k == "long" else max_tokens for k in lengths},
            "inject_after": inject_after}


def simulate_token_times(run: dict, layout: str, costs, decode_costs=None, transfer_s=0.0,
                         config: SimConfig | None = None) -> dict:
    """The simulator's `token_times` for the same requests: shorts at 0, the long prompt by the
    run's own rule (once every short has `inject_after` tokens, in simulated time, so a run slowed
    by other work on the machine replays the same event; a run without `inject_after`: at its
    `long_arrival_s`); `layout` "colocated" (costs) or "disaggregated" (prefill costs, decode
    costs, KV transfer seconds or a function of L)."""
    if layout not in ("colocated", "disaggregated"):
        raise ValueError(f"layout must be 'colocated' or 'disaggregated', got {layout!r}")

    def simulate(ids: list[str], long_at: float) -> list:
        reqs = [SimRequest(long_at if k == "long" else 0.0, run["prompt_tokens"][k], run["max_tokens"][k])
                for k in ids]
        if layout == "colocated":
            return simulate_colocated(reqs, costs, config)
        return simulate_disaggregated(reqs, costs, decode_costs or costs, transfer_s, config,
                                      transfer_blocks_prefill=True)
    ids, arrival = list(run["prompt_tokens"]), run["long_arrival_s"]
    n = run.get("inject_after")
    shorts = [k for k in ids if k != "long"]
    if n is not None and shorts:          # until the long prompt arrives, the shorts run alone
        arrival = max(r.token_times[n - 1] for r in simulate(shorts, 0.0))
    res = simulate(ids, arrival)
    return {**run, "long_arrival_s": arrival, "times": {k: list(r.token_times) for k, r in zip(ids, res)}}


def stall_summary(run: dict) -> dict:
    """{"max_gap_s", "median_gap_s"} between consecutive tokens of the short requests from the
    long prompt's arrival on, and the long prompt's "long_ttft_s"."""
    t_in = run["long_arrival_s"]
    gaps = [b - a for k, ts in run["times"].items() if k != "long"
            for a, b in zip(ts, ts[1:]) if b > t_in]
    if not gaps:
        raise ValueError("no short request produced a token after the long prompt arrived")
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
            "long_ttft_s": run["times"]["long"][0] - t_in}
