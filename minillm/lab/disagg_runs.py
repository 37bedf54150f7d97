"""Chapter 11's measured comparison: colocated against disaggregated serving on this machine, and
the simulator's prediction beside every measurement.

`long_among_short`: short chats (20-60 prompt tokens) among long prompts (400-800, a quarter of
requests), every answer `max_tokens` long, Poisson arrivals. `drive(base_url, ...)` sends it to
an OpenAI-compatible server (completions endpoint) and returns TTFT and inter-token gaps as the
client saw them. `probe_step_costs(base_url, ...)` fits DistServe's formulas to a running
server's lone-prompt TTFTs and decode gaps, so costs come from the very process the runs see.
`predict(...)` replays the same arrivals and token counts through analysis/disagg_sim.py, the KV
transfer priced by this machine's gloo send and sent by the prefill worker before its next
prefill (`transfer_blocks_prefill`). `compare` shows TTFT and ITL percentiles, SLO attainment,
goodput and the prediction's relative error.

Left out on purpose: starting the servers (benchmarks/disaggregation.py does, with
`python -m minillm serve [--disaggregated]`), multi-turn chats and outputs that end at EOS.
"""
import random
from dataclasses import dataclass

from minillm._validate import check_int, check_real
from minillm.analysis.disagg_sim import (SimConfig, SimRequest, kv_transfer_time, poisson_arrivals,
                                         simulate_colocated, simulate_disaggregated)
from minillm.analysis.slo import summarize
from minillm.analysis.step_fit import StepCosts
from minillm.lab.datasets import load_prompts
from minillm.lab.loadgen import _run_async
from minillm.lab.serve_client import run_load

LONG_TOKENS, SHORT_TOKENS = (400, 800), (20, 60)


@dataclass
class Workload:
    rate: float                  # requests per second offered
    seed: int                    # seeds the arrivals (the load generator draws the same ones)
    prompts: list[str]
    prompt_tokens: list[int]     # by the tokenizer given; the server's count may differ by one
    max_tokens: int

    @property
    def arrivals(self) -> list[float]:
        return poisson_arrivals(self.rate, len(self.prompts), self.seed)


def _text(tokenizer, pool: list[str], length: int, rng: random.Random) -> str:
    """`length` tokens of text cut from the pool's texts, joined from a random start."""
    ids, k = [], rng.randrange(len(pool))
    while len(ids) < length:
        ids += tokenizer.encode(pool[k % len(pool)] + "\n\n")
        k += 1
    return tokenizer.decode(ids[:length])


def long_among_short(tokenizer, n: int = 16, rate: float = 0.5, seed: int = 0,
                     long_fraction: float = 0.25, long_tokens=LONG_TOKENS, short_tokens=SHORT_TOKENS,
                     max_tokens: int = 16) -> Workload:
    """n requests: a `long_fraction` of them long prompts (code, `long_tokens` range), the rest
    short chats (`short_tokens`), in a seeded random order."""
    check_int("n", n, 1)
    check_real("rate", rate, 0, low_open=True)
    check_real("long_fraction", long_fraction, 0, 1)
    check_int("max_tokens", max_tokens, 1)
    for name, (lo, hi) in (("long_tokens", long_tokens), ("short_tokens", short_tokens)):
        check_int(f"{name}[0]", lo, 1)
        check_int(f"{name}[1]", hi, lo)
    rng = random.Random(seed)
    code, chat = load_prompts("humaneval", 64, seed), load_prompts("chapters", 64, seed)
    num_long = round(long_fraction * n)
    kinds = [True] * num_long + [False] * (n - num_long)
    rng.shuffle(kinds)
    prompts = [_text(tokenizer, code, rng.randint(*long_tokens), rng) if is_long else
               _text(tokenizer, chat, rng.randint(*short_tokens), rng) for is_long in kinds]
    return Workload(rate, seed, prompts, [len(tokenizer.encode(p)) for p in prompts], max_tokens)


def drive(base_url: str, model: str, workload: Workload, timeout_s: float = 600.0):
    """Send the workload (streamed, greedy, ignore_eos) -> (results, wall seconds)."""
    return _run_async(run_load(base_url, model, workload.prompts, endpoint="completions",
                               request_rate=workload.rate, max_tokens=workload.max_tokens,
                               ignore_eos=True, seed=workload.seed, timeout_s=timeout_s))


def _token_times(r) -> list[float]:
    """A streamed request's token arrival times (perf_counter seconds)."""
    t = [r.start + r.ttft]
    for gap in r.itl:
        t.append(t[-1] + gap)
    return t


def probe_step_costs(base_url: str, model: str, tokenizer, prompt_lengths=(32, 96, 192, 384),
                     batch_sizes=(1, 4, 8), contexts=(32, 256), max_tokens: int = 16,
                     rounds: int = 2, seed: int = 0) -> dict:
    """A running server's step costs, probed through its API and fitted (step_fit.py):
    - prefill: one request of L prompt tokens alone, its TTFT (one step when L fits the chunk);
    - decode: B requests of S tokens sent together, the median gap between tokens once every
      one of them has its first token (steps holding the B decodes only), at context S + the
      tokens decoded so far, taken as S + max_tokens / 2.
    -> {"prefill", "decode", "costs", "error"} as `lab.step_costs.measure_step_costs`."""
    import statistics
    from minillm.analysis.step_fit import fit_error, fit_step_costs
    rng = random.Random(seed)
    chat = load_prompts("humaneval", 64, seed)
    pre, dec = {}, {}

    def run(prompts, tokens):
        results, _ = _run_async(run_load(base_url, model, prompts, endpoint="completions",
                                         max_tokens=tokens, ignore_eos=True))
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"a probe failed: {bad[0]}")
        return results
    for _ in range(rounds):
        for n in prompt_lengths:
            (r,) = run([_text(tokenizer, chat, n, rng)], 2)
            pre.setdefault(r.prompt_tokens or n, []).append(r.ttft)
        for b in batch_sizes:
            for s in contexts:
                results = run([_text(tokenizer, chat, s, rng) for _ in range(b)], max_tokens)
                times = [_token_times(r) for r in results]
                start = max(t[0] for t in times)
                gaps = [y - x for t in times for x, y in zip(t, t[1:]) if x >= start]
                if gaps:
                    dec.setdefault((b, s), []).append(statistics.median(gaps))
    prefill = [([n], statistics.median(t)) for n, t in sorted(pre.items())]
    decode = [([s + max_tokens // 2] * b, statistics.median(t)) for (b, s), t in sorted(dec.items())]
    costs = fit_step_costs(prefill, decode)
    return {"prefill": prefill, "decode": decode, "costs": costs,
            "error": fit_error(costs, prefill, decode)}


def sim_requests(workload: Workload, results=None) -> list[SimRequest]:
    """The workload's arrivals, with the token counts the server reported where it did."""
    out = []
    for i, t in enumerate(workload.arrivals):
        r = results[i] if results is not None else None
        prompt = r.prompt_tokens if r is not None and r.ok and r.prompt_tokens else workload.prompt_tokens[i]
        output = r.output_tokens if r is not None and r.ok and r.output_tokens else workload.max_tokens
        out.append(SimRequest(t, prompt, output))
    return out


def predict(layout: str, requests: list[SimRequest], costs: StepCosts,
            decode_costs: StepCosts | None = None, transfer_link=None, kv_cfg=None,
            config: SimConfig | None = None) -> list:
    """Simulated results of `layout` "colocated" (costs) or "disaggregated" (costs: the prefill
    engine's, decode_costs: the decode engine's, KV over `transfer_link` in fp32)."""
    if layout == "colocated":
        return simulate_colocated(requests, costs, config)
    if layout != "disaggregated":
        raise ValueError(f"layout must be 'colocated' or 'disaggregated', got {layout!r}")
    transfer = 0.0 if transfer_link is None else (
        lambda n: kv_transfer_time(kv_cfg, n, transfer_link, dtype="fp32"))
    return simulate_disaggregated(requests, costs, decode_costs or costs, transfer, config,
                                  transfer_blocks_prefill=True)


def measured(results) -> list[dict]:
    """The load generator's results as the simulator's: {"ttft", "itls"} of the requests that
    finished."""
    return [{"ttft": r.ttft, "itls": list(r.itl)} for r in results if r.ok]


def compare(results, duration_s: float, predicted, ttft_s: float, itl_s: float) -> dict:
    """{"measured": summary, "predicted": summary, "error": relative error of the prediction
    for goodput, attainment, TTFT p50/p90 and ITL p50/p90, "failed": requests that failed}."""
    got = summarize(measured(results), ttft_s, itl_s, duration_s)
    sim_duration = max(r.finish_s for r in predicted)
    want = summarize(predicted, ttft_s, itl_s, sim_duration)

    def rel(a, b):
        return None if a in (None, 0) or b is None else round((b - a) / a, 3)
    error = {"goodput": rel(got["goodput"], want["goodput"]),
             "attainment": rel(got["attainment"], want["attainment"])}
    for key in ("ttft_ms", "itl_ms"):
        for p in ("p50", "p90"):
            error[f"{key[:-3]}_{p}"] = rel(got[key][p], want[key][p])
    return {"measured": got, "predicted": want, "error": error,
            "failed": sum(not r.ok for r in results)}


def comparison_table(rows: list[dict]) -> str:
    """One line per (layout, rate): measured / predicted TTFT p50, p90, ITL p50, p90 (ms),
    attainment and goodput."""
    head = (f"{'layout':14s} {'rate':>5s} | {'TTFT p50':>13s} {'TTFT p90':>13s} {'ITL p50':>11s} "
            f"{'ITL p90':>11s} | {'attain':>11s} {'goodput/s':>11s}")
    lines = [head, " " * 21 + "(measured / predicted)"]
    for row in rows:
        m, p = row["measured"], row["predicted"]
        pair = lambda a, b, f: f"{a:{f}}/{b:{f}}" if a is not None and b is not None else "-"  # noqa: E731
        lines.append(f"{row['layout']:14s} {row['rate']:5.2f} | "
                     f"{pair(m['ttft_ms']['p50'], p['ttft_ms']['p50'], '.0f'):>13s} "
                     f"{pair(m['ttft_ms']['p90'], p['ttft_ms']['p90'], '.0f'):>13s} "
                     f"{pair(m['itl_ms']['p50'], p['itl_ms']['p50'], '.0f'):>11s} "
                     f"{pair(m['itl_ms']['p90'], p['itl_ms']['p90'], '.0f'):>11s} | "
                     f"{pair(m['attainment'], p['attainment'], '.2f'):>11s} "
                     f"{pair(m['goodput'], p['goodput'], '.2f'):>11s}")
    return "\n".join(lines)
