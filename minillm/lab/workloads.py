"""Seeded serving workloads and a replay loop that feeds them to an `LLMEngine`.

A workload is a list of `WorkloadRequest(arrival, prompt_token_ids, max_tokens, priority=0)`,
with random token ids (cost depends on lengths, not meaning): `poisson_workload` (Poisson
arrivals, bounded-Pareto lengths), `long_prompt_workload` (one long prompt among steady decodes),
`shared_prefix_workload` (one system prompt), `priority_mix_workload` (interactive and batch).

`replay(engine, workload)` adds each request when its arrival is due, on the wall clock
(`time_unit="seconds"`, idle gaps skipped) or on the step counter (`time_unit="steps"`,
deterministic), passing `priority` on, and steps until all finish; `step_seconds` (steps only)
gives the engine a simulated clock, so queue-wait bounds act the same on every machine.
`request_latencies(outputs, trace)` gives per-request TTFT and decode gaps in steps and seconds;
`load_sweep` serves one workload at several loads; `step_latencies` and `batch_occupancy` count
from the engine's metrics and trace.

Left out on purpose: real conversation traces and token-level streaming to clients.
"""
import math
import random
import time
from dataclasses import dataclass

from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import RequestOutput


@dataclass(frozen=True)
class WorkloadRequest:
    arrival: float                  # seconds (or steps) after the start
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0               # lower = served first (scheduling_policy="priority" only)


def heavy_tailed_lengths(rng: random.Random, n: int, low: int, high: int, alpha: float = 1.2) -> list[int]:
    """n draws from a Pareto(alpha) scaled to start at `low`, clipped at `high` (ints)."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    return [min(high, int(low * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(n)]


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(1, vocab_size) for _ in range(n)]


def poisson_workload(num_requests: int, rate: float, vocab_size: int, seed: int = 0,
                     prompt_len: tuple[int, int] = (16, 256), output_len: tuple[int, int] = (8, 256),
                     alpha: float = 1.2) -> list[WorkloadRequest]:
    """`rate` requests per second on average (math.inf: all arrive at time 0)."""
    if num_requests < 1 or rate <= 0:
        raise ValueError(f"need num_requests >= 1 and rate > 0, got {num_requests}, {rate}")
    rng = random.Random(seed)
    plens = heavy_tailed_lengths(rng, num_requests, *prompt_len, alpha=alpha)
    olens = heavy_tailed_lengths(rng, num_requests, *output_len, alpha=alpha)
    t, out = 0.0, []
    for p, o in zip(plens, olens):
        out.append(WorkloadRequest(t, _tokens(rng, p, vocab_size), o))
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return out


def long_prompt_workload(vocab_size: int, num_running: int = 8, output_len: int = 64,
                         short_prompt_len: int = 16, long_prompt_len: int = 1024,
                         arrival: float = 8, seed: int = 0,
                         num_behind: int = 0) -> list[WorkloadRequest]:
    """`num_running` short requests start at 0; one `long_prompt_len` prompt arrives at `arrival`,
    followed in the queue by `num_behind` short requests arriving at the same moment (they wait
    behind it: head-of-line blocking). Order: running, long, behind."""
    if isinstance(num_behind, bool) or not isinstance(num_behind, int) or num_behind < 0:
        raise ValueError(f"num_behind must be an int >= 0, got {num_behind!r}")
    rng = random.Random(seed)
    reqs = [WorkloadRequest(0.0, _tokens(rng, short_prompt_len, vocab_size), output_len)
            for _ in range(num_running)]
    reqs.append(WorkloadRequest(float(arrival), _tokens(rng, long_prompt_len, vocab_size), 8))
    return reqs + [WorkloadRequest(float(arrival), _tokens(rng, short_prompt_len, vocab_size), 8)
                   for _ in range(num_behind)]


def shared_prefix_workload(num_requests: int, vocab_size: int, system_len: int = 256,
                           user_len: tuple[int, int] = (8, 64), output_len: int = 16,
                           seed: int = 0) -> list[WorkloadRequest]:
    """All prompts = one shared system prompt + a short user part; all arrive at 0."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab_size)
    return [WorkloadRequest(0.0, system + _tokens(rng, rng.randint(*user_len), vocab_size), output_len)
            for _ in range(num_requests)]


def priority_mix_workload(num_requests: int, rate: float, vocab_size: int, seed: int = 0,
                          interactive_share: float = 0.5,
                          interactive: tuple = ((8, 32), (4, 16), 0),
                          batch: tuple = ((32, 128), (48, 128), 2)) -> list[WorkloadRequest]:
    """Poisson arrivals (`rate` per second or per step) of two kinds of traffic, each request
    interactive with probability `interactive_share`. A kind is (prompt_len range, output_len
    range, priority); lengths are uniform in their ranges."""
    if num_requests < 1 or not 0 < rate < math.inf or not 0 <= interactive_share <= 1:
        raise ValueError(f"need num_requests >= 1, finite rate > 0, 0 <= interactive_share <= 1, "
                         f"got {num_requests}, {rate}, {interactive_share}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        (plo, phi), (olo, ohi), prio = interactive if rng.random() < interactive_share else batch
        out.append(WorkloadRequest(t, _tokens(rng, rng.randint(plo, phi), vocab_size),
                                   rng.randint(olo, ohi), prio))
        t += rng.expovariate(rate)
    return out


def replay(engine, workload: list[WorkloadRequest], time_unit: str = "seconds",
           params: SamplingParams | None = None, use_tqdm: bool = False,
           step_seconds: float | None = None) -> list[RequestOutput]:
    """Serve the workload to completion; returns one RequestOutput per request, in workload order.

    Each request uses `params` (greedy, ignore_eos by default) with its own `max_tokens`.
    Requests that end early (a queue timeout's "abort") count as done."""
    if time_unit not in ("seconds", "steps"):
        raise ValueError(f"time_unit must be 'seconds' or 'steps', got {time_unit!r}")
    if step_seconds is not None and (time_unit != "steps" or isinstance(step_seconds, bool) or
                                     not isinstance(step_seconds, (int, float)) or not 0 < step_seconds < math.inf):
        raise ValueError(f"step_seconds must be None or a finite number > 0 with time_unit='steps', "
                         f"got {step_seconds!r} with {time_unit!r}")
    from tqdm.auto import tqdm
    base = params or SamplingParams(ignore_eos=True)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    offset, skipped = [0.0], 0                           # idle time jumped over (s / steps)
    engine.clock = lambda: time.perf_counter() + offset[0]
    step0 = engine.step_count
    if step_seconds is not None:                         # simulated: every step lasts step_seconds
        engine.clock = lambda: (engine.step_count - step0 + skipped) * step_seconds
    t0 = engine.clock()
    by_class = engine.config.scheduling_policy == "priority"
    rids, done, nxt = {}, {}, 0
    bar = tqdm(total=len(workload), disable=not use_tqdm, desc="requests")
    while len(done) < len(workload):
        now = engine.clock() - t0 if time_unit == "seconds" else engine.step_count - step0 + skipped
        if nxt < len(order) and not engine.has_unfinished_requests():
            gap = workload[order[nxt]].arrival - now
            if gap > 0 and time_unit == "seconds":   # nothing to do: jump the clock ahead
                offset[0] += gap
                now += gap
            elif gap > 0:
                skipped += math.ceil(gap)
                now += math.ceil(gap)
        while nxt < len(order) and workload[order[nxt]].arrival <= now:
            w = workload[order[nxt]]
            arrival = t0 + w.arrival if time_unit == "seconds" else None
            p = SamplingParams(**{**base.__dict__, "max_tokens": w.max_tokens})
            rids[engine.add_request(w.prompt_token_ids, p, arrival_time=arrival,
                                    priority=w.priority if by_class else 0)] = order[nxt]
            nxt += 1
        for out in engine.step():
            if out.finished and out.request_id in rids:
                done[rids[out.request_id]] = out
                bar.update(1)
    bar.close()
    return [done[i] for i in range(len(workload))]


def request_latencies(outputs: list[RequestOutput], trace: list[dict]) -> list[dict]:
    """Per request, in the order of `outputs` (from `replay`), from its metrics and the engine trace:
    - 'ttft_steps': engine steps from its arrival through the one that sampled its first token
      (1: the very next step did it); deterministic, unlike
    - 'ttft': the same wait in seconds;
    - 'max_gap_steps': most engine steps between two of its decode tokens (1: a token every step);
    - 'itl': its inter-token gaps in seconds (completion 0)."""
    decode_steps: dict[str, list[int]] = {}
    for row in trace:
        pre = set(row["prefill_request_ids"])
        for rid in row["request_ids"]:
            if rid not in pre:
                decode_steps.setdefault(rid, []).append(row["step"])
    rows = []
    for o in outputs:
        m, steps = o.metrics, decode_steps.get(o.request_id, [])
        rows.append(dict(
            ttft_steps=None if m.first_token_step is None else m.first_token_step - m.arrival_step + 1,
            ttft=m.ttft, max_gap_steps=max((b - a for a, b in zip(steps, steps[1:])), default=None),
            itl=[b - a for a, b in zip(m.token_times, m.token_times[1:])]))
    return rows


# ---- latency against offered load (chapter 4) ---------------------------------------------------
def step_latencies(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    """Per-request latencies counted in engine steps (deterministic: they depend only on the
    schedule, not on the machine). ttft: steps from arrival up to and including the step that
    produced the first token (1 = served at once); tpot: steps per output token after the first
    (1.0 = a token every step); e2e: steps from arrival to the last token."""
    ttft, tpot, e2e = [], [], []
    for o in outputs:
        m = o.metrics
        if m.first_token_step is None or m.finish_step is None:
            raise ValueError(f"request {o.request_id} has not finished: serve the workload first")
        ttft.append(float(m.first_token_step - m.arrival_step + 1))
        e2e.append(float(m.finish_step - m.arrival_step + 1))
        if m.num_generated > 1:
            tpot.append((m.finish_step - m.first_token_step) / (m.num_generated - 1))
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def batch_occupancy(trace: list[dict], max_num_seqs: int) -> float:
    """Mean fraction of the batch's slots that hold a live request, over the steps of `trace`
    (a static batch's finished members, padding rows, do not count)."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
    if not trace:
        raise ValueError("trace is empty: run the engine first")
    return sum(r["num_seqs"] for r in trace) / (len(trace) * max_num_seqs)


def load_sweep(model, loads: list[float], config, num_requests: int = 200, seed: int = 0,
               prompt_len: tuple[int, int] = (8, 64), output_len: tuple[int, int] = (4, 96),
               percentiles: tuple[float, ...] = (50, 90, 99)) -> list[dict]:
    """Latency against offered load: one run per load, Poisson arrivals on the step clock.

    Offered load rho = arrival rate x mean output tokens / max_num_seqs: the fraction of the
    batch's slot-steps the requests ask for (each request holds a slot for one step per output
    token), so rho = 1 is saturation. The same seeded lengths are used at every load (only the
    gaps between arrivals shrink). Each row: load, rate (requests per step), steps, occupancy,
    and per metric the percentiles in steps (`ttft_p99`, ...) and in seconds (`ttft_p99_s`, ...,
    wall clock: machine-dependent)."""
    import numpy as np
    if not loads or any(not isinstance(x, (int, float)) or not 0 < x < math.inf for x in loads):
        raise ValueError(f"loads must be a non-empty list of finite numbers > 0, got {loads!r}")
    from minillm.engine.llm_engine import LLMEngine
    vocab = model.config.vocab_size
    kw = dict(prompt_len=prompt_len, output_len=output_len)
    mean_out = sum(w.max_tokens for w in poisson_workload(num_requests, math.inf, vocab, seed, **kw)) / num_requests
    rows = []
    for rho in loads:
        rate = rho * config.max_num_seqs / mean_out
        work = poisson_workload(num_requests, rate, vocab, seed, **kw)
        engine = LLMEngine(model, config)
        outs = replay(engine, work, time_unit="steps")
        row = {"load": float(rho), "rate": rate, "steps": len(engine.trace),
               "occupancy": batch_occupancy(engine.trace, config.max_num_seqs)}
        wall = {"ttft": [o.metrics.ttft for o in outs], "e2e": [o.metrics.e2e for o in outs],
                "tpot": [o.metrics.tpot for o in outs if o.metrics.tpot is not None]}
        for key, vals in step_latencies(outs).items():
            for p in percentiles:
                row[f"{key}_p{p:g}"] = float(np.percentile(vals, p))
                row[f"{key}_p{p:g}_s"] = float(np.percentile(wall[key], p))
        rows.append(row)
    return rows
