"""Chapter 8's exercises (serving over HTTP). Keys "08.N" as numbered in the notebook.

08.1 is judged against a count of requests inside a steady server (Little's law, without its
formula), 08.4 against a gamma distribution's spread (the sum of two gaps), 08.6 against the
engine on a tiny model with a simulated clock. The code exercises run the reader's function on
inputs made when they check: Prometheus' histogram quantile (08.2, against a plain implementation
here, on histograms filled by prometheus_client with the server's buckets), the text of a
streamed chat answer (08.3, on event streams written by `serve.responses` with interleaved
completions, multi-byte characters and a usage chunk), the load generator's TPOT (08.5, against
`lab.serve_metrics.RequestResult`) and the priority scheduler's memory-pressure victim (08.7,
against `PriorityScheduler`) and an answer's perplexity from its logprobs (08.8, on random logprob
lists). 08.9 (logprobs at a temperature) and 08.10 (a choice under a token mask) are judged
against the formula on their numbers.
"""
import json
import math
import random

from minillm.exercises import call_reader, code, numeric


def bucket_quantile(bounds, cumulative, q: float) -> float:
    """Prometheus' histogram_quantile: linear inside the bucket that holds rank q * total."""
    total = cumulative[-1]
    rank = q * total
    for i, (bound, count) in enumerate(zip(bounds, cumulative)):
        if count >= rank:
            if bound == float("inf"):
                return bounds[i - 1]                 # no upper bound: the highest finite one
            lower = bounds[i - 1] if i else 0.0
            below = cumulative[i - 1] if i else 0
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
    return bounds[-2]


def _histograms(seed: int = 3):
    """(bounds, cumulative counts) of histograms filled as the server fills its own: by
    prometheus_client, with the server's latency buckets."""
    from prometheus_client import CollectorRegistry, Histogram

    from minillm.serve.metrics import LATENCY_BUCKETS
    rng = random.Random(seed)
    for n, scale in ((50, 0.1), (400, 1.5), (7, 30.0), (1000, 0.02)):
        registry = CollectorRegistry()
        h = Histogram("x", "x", buckets=LATENCY_BUCKETS, registry=registry)
        for _ in range(n):
            h.observe(rng.lognormvariate(0, 1) * scale)
        buckets = [(float(s.labels["le"]), s.value) for s in next(iter(registry.collect())).samples
                   if s.name == "x_bucket"]
        yield [b for b, _ in buckets], [int(c) for _, c in buckets]


def _test_quantile(candidate) -> None:
    if not callable(candidate):
        raise AssertionError("pass your function quantile(bounds, cumulative, q) -> float")
    for bounds, cum in _histograms():
        for q in (0.5, 0.9, 0.95, 0.99):
            want = bucket_quantile(bounds, cum, q)
            got = call_reader(candidate, list(bounds), list(cum), q)
            if not isinstance(got, (int, float)) or abs(got - want) > 1e-9 * max(1.0, abs(want)):
                raise AssertionError(f"q={q} on a histogram of {cum[-1]} requests: a different value "
                                     f"(interpolate linearly inside the bucket)")


def _stream(texts: list[str], seed: int) -> list[str]:
    """SSE lines of a chat stream of len(texts) completions, pieces interleaved, usage at the end."""
    from minillm.engine.sampling_params import SamplingParams
    from minillm.serve.protocol import GenRequest
    from minillm.serve.responses import chunk, usage_chunk
    rng = random.Random(seed)
    req = GenRequest("chat", "m", [1, 2, 3], SamplingParams(n=len(texts)), True, True, 0)
    pieces = {}
    for i, t in enumerate(texts):
        cuts = sorted(rng.sample(range(1, len(t)), min(4, len(t) - 1)))
        pieces[i] = [t[a:b] for a, b in zip([0] + cuts, cuts + [len(t)])]
    events = [chunk(req, "id", i, None, first=True) for i in range(len(texts))]
    while any(pieces.values()):
        i = rng.choice([k for k, v in pieces.items() if v])
        events.append(chunk(req, "id", i, pieces[i].pop(0)))
    events += [chunk(req, "id", i, None, "stop") for i in range(len(texts))]
    events.append(usage_chunk(req, "id", 9))
    lines = []
    for e in events:
        lines += ["data: " + json.dumps(e, ensure_ascii=False), ""]
    return lines + ["data: [DONE]", ""]


def _test_stream_text(candidate) -> None:
    if not callable(candidate):
        raise AssertionError("pass your function stream_text(lines) -> dict {index: text}")
    cases = [["Paris is the capital of France."], ["こんにちは、世界", "Grüße aus Köln — café"],
             ["a\n\nb", "Привет", "12345"]]
    for seed, texts in enumerate(cases):
        got = call_reader(candidate, _stream(texts, seed))
        if not isinstance(got, dict):
            raise AssertionError("return a dict {completion index: its text}")
        if got != dict(enumerate(texts)):
            raise AssertionError(f"a stream of {len(texts)} completion(s): the texts differ")


def _requests_inside(rate: float = 3.0, stay: float = 4.0, horizon: float = 100.0) -> float:
    """The time-average number of requests inside a server where one arrives every 1/rate s and
    each stays `stay` s, counted over a long steady stretch (no formula: a count)."""
    arrivals = [k / rate for k in range(int(horizon * rate))]
    probes = [stay + (horizon - 2 * stay) * i / 997 for i in range(997)]
    return sum(sum(a <= t < a + stay for a in arrivals) for t in probes) / len(probes)


numeric("08.1", "A server receives 3 requests per second on average, and a request spends 4 s on "
        "average between arriving and its last token. How many requests are inside the server "
        "(waiting or running) on average?", _requests_inside, rtol=0.01,
        hint="recompute section 9's L column from these two numbers: what does it multiply, and "
             "are both in the same unit of time?")
code("08.2", "Write quantile(bounds, cumulative, q): the q-quantile of a Prometheus histogram "
     "(bounds: the bucket upper bounds, the last float('inf'); cumulative: requests at or under "
     "each bound), as Prometheus computes it.", _test_quantile,
     hint="find the first bucket whose cumulative count reaches q * total, then interpolate "
          "linearly between its lower and upper bound")
code("08.3", "Write stream_text(lines) -> {index: text}: the text of each completion of a "
     "streamed chat answer, given the SSE lines as they arrive ('data: {...}', blank lines, "
     "'data: [DONE]').", _test_stream_text,
     hint="skip blank lines and [DONE]; a usage chunk has no choices; add delta.content by "
          "choice index")


# ---- section 7: the load generator --------------------------------------------------------------
def _test_tpot_ms(candidate) -> None:
    from minillm.lab.serve_metrics import RequestResult
    if not callable(candidate):
        raise AssertionError("pass your function tpot_ms(ttft_s, e2e_s, output_tokens)")
    rng = random.Random(8)
    cases = [(0.2, 1.2, 11), (0.05, 0.05, 1), (0.5, 0.9, 2), (1.0, 1.0, 0)]
    cases += [(t, t + rng.uniform(0, 5), rng.randint(1, 300)) for t in (rng.uniform(0, 2) for _ in range(20))]
    for ttft, e2e, n in cases:
        want = 1e3 * RequestResult(ok=True, ttft=ttft, e2e=e2e, output_tokens=n).tpot
        got = float(call_reader(candidate, ttft, e2e, n))
        if math.isnan(want):
            if not math.isnan(got):
                raise AssertionError(f"with {n} output token(s) there is no gap between tokens")
        elif not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
            raise AssertionError(f"ttft={ttft:.3f} s, e2e={e2e:.3f} s, {n} tokens: a different value")


numeric("08.4", "Arrivals at 4 requests/s with --burstiness 0.25 (gamma gaps of shape 0.25, mean "
        "1/rate, independent of each other): the standard deviation, in seconds, of the time from "
        "one request to the second request after it (two gaps).",
        lambda: math.sqrt(2 * 0.25) * (1.0 / (4.0 * 0.25)), rtol=0.01,
        hint="get one gap's mean and spread as section 9 does for its burstiness table, then add "
             "two independent gaps: what adds, the standard deviations or the variances?")
code("08.5", "Write tpot_ms(ttft_s, e2e_s, output_tokens) -> the time per output token after the "
     "first, in ms, as the load generator defines it (nan with fewer than 2 output tokens).",
     _test_tpot_ms, hint="recompute what section 9's TPOT column averages: which tokens it counts "
     "(the first is TTFT's), which stretch of time they share, and what is left with one token")


# ---- section 8: priorities -----------------------------------------------------------------------
def _steps_until_rejected() -> float:
    """One seat held for 20 steps by an interactive request; a batch request (max_queue_wait
    0.2 s, reject) arrives before step 1; every step lasts 30 ms on a simulated clock."""
    import torch
    from minillm.model.loading import tiny_model
    from minillm.engine.llm_engine import EngineConfig, LLMEngine
    from minillm.engine.policies.priority import PriorityClass
    from minillm.engine.sampling_params import SamplingParams
    classes = (PriorityClass("interactive", 0), PriorityClass("batch", 2, 0.2, "reject"))
    engine = LLMEngine(tiny_model(vocab_size=64, dtype=torch.float64),
                       EngineConfig(max_num_seqs=1, num_blocks=32, block_size=4, max_num_batched_tokens=8,
                                    scheduling_policy="priority", priority_classes=classes))
    engine.clock = lambda: engine.step_count * 0.03
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=20))
    engine.step()
    rid = engine.add_request([4, 5, 6], SamplingParams(max_tokens=4), priority=2)
    while not engine.requests[rid].finished:
        engine.step()
    m = engine.requests[rid].metrics
    return m.finish_step - m.arrival_step


def _running(rng: random.Random, n: int) -> list[dict]:
    return [{"priority": rng.choice([0, 1, 2]), "arrival": rng.choice([0.0, 1.0, 2.0, 3.0]) + i * 1e-3,
             "promoted": rng.random() < 0.2} for i in range(n)]


def _test_victim(candidate) -> None:
    from minillm.engine.policies.priority import PriorityScheduler
    from minillm.engine.sampling_params import SamplingParams
    from minillm.engine.sequence import Sequence
    if not callable(candidate):
        raise AssertionError("pass your function victim(running) -> index of the request to preempt")
    rng = random.Random(8)
    for n in [1, 2, 3, 5, 8] * 8:
        running = _running(rng, n)
        seqs = [Sequence(i, str(i), [1], SamplingParams(), r["arrival"], priority=r["priority"],
                         promoted=r["promoted"]) for i, r in enumerate(running)]
        want = max(range(n), key=lambda i: PriorityScheduler._victim_key(None, seqs[i]))
        got = call_reader(candidate, [dict(r) for r in running])
        if got != want:
            raise AssertionError(f"on a batch of {n} running requests your victim is not the scheduler's")


numeric("08.6", "Seed 001's 200 ms queue timeout with on_timeout='reject' on the batch class; every "
        "engine step lasts 30 ms and the bound is checked at the start of each step. A batch request "
        "arrives (between two steps) when the only seat is taken for the next 20 steps. How many "
        "steps after it arrived is it rejected (1 = at the very next step)?",
        _steps_until_rejected, rtol=0, atol=0.01,
        hint="list the start times of the steps after its arrival, 30 ms apart, and find the first "
             "whose wait is over the bound (a wait equal to it is not over)")
code("08.7", "Write victim(running) -> the index of the request a priority scheduler preempts when the "
     "KV pool is empty. running: a list of dicts with 'priority' (lower = more important), 'arrival' "
     "(seconds, all different) and 'promoted' (waited past its class's bound); checked against "
     "PriorityScheduler on random lists.", _test_victim,
     hint="a promoted request ranks above every class; among equals the latest arrival goes first")


# ---- logprobs and constrained decoding -----------------------------------------------------------
def _content(rng: random.Random, n: int) -> list[dict]:
    """A chat answer's `logprobs.content`: n tokens, each with its logprob and 3 alternatives."""
    out = []
    for i in range(n):
        lps = sorted((math.log(rng.uniform(1e-4, 1.0)) for _ in range(3)), reverse=True)
        pick = rng.randrange(3)
        tok = f"t{i}"
        top = [{"token": tok if j == pick else f"a{i}_{j}", "logprob": lp, "bytes": None}
               for j, lp in enumerate(lps)]
        out.append({"token": tok, "logprob": lps[pick], "bytes": list(tok.encode()), "top_logprobs": top})
    return out


def _test_perplexity(candidate) -> None:
    if not callable(candidate):
        raise AssertionError("pass your function perplexity(content) -> float")
    rng = random.Random(88)
    for n in (1, 2, 7, 40):
        content = _content(rng, n)
        want = math.exp(-sum(t["logprob"] for t in content) / n)
        got = call_reader(candidate, [dict(t) for t in content])
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9):
            raise AssertionError(f"an answer of {n} token(s): a different value")


code("08.8", "Write perplexity(content) -> float: the perplexity of a chat answer from its "
     "`choices[0].logprobs.content` list (one dict per token with 'token', 'logprob', 'bytes', "
     "'top_logprobs').", _test_perplexity,
     hint="the exponential of the mean surprise (minus the logprob) of the tokens the answer took; "
          "the alternatives in top_logprobs do not count")
numeric("08.9", "At temperature 0.5 the model's logits for two tokens differ by 1.0. By how much do "
        "the logprobs the server reports for those two tokens differ (the log-probabilities of "
        "the distribution the token is sampled from)?", lambda: 1.0 / 0.5, rtol=1e-6,
        hint="recompute both logprobs from the logits the sampler really used (section 7 checks "
             "this against a forward pass); what does their difference keep of the normalizer?")
numeric("08.10", "A request with guided_choice ['yes', 'no'], sampled at temperature 1. At the first "
        "position the model gives the token 'yes' probability 0.2, the token 'no' 0.1, and 0.7 to "
        "everything else (each answer is one token). What is the probability the answer is 'yes'?",
        lambda: 0.2 / (0.2 + 0.1), rtol=1e-6,
        hint="recompute the distribution after section 8's mask: which probabilities are left, and "
             "what must they add up to?")


# ---- appendix 08b: operating the server --------------------------------------------------------
def _decisions_to_floor(budget: int = 512, floor: int = 8, down: float = 0.75) -> float:
    n = 0
    while budget > floor:
        budget, n = max(floor, math.floor(budget * down)), n + 1
    return n


def _tier_blocks(layers: int = 24, kv_heads: int = 4, head_dim: int = 96, block: int = 32,
                 dtype_bytes: int = 2, gib: float = 0.3) -> float:
    per_block = 2 * layers * kv_heads * head_dim * block * dtype_bytes      # K and V, every layer
    return int(gib * 2**30) // per_block


def _recompute_over_restore() -> float:
    from minillm.analysis.kv_math import kv_cache_bytes
    from minillm.model.config import get_config
    restore = kv_cache_bytes(get_config("smollm2-135m"), 16, dtype="fp32") / 8e9
    return 16 * 0.27e9 / 50e9 / restore


numeric("08.11", "The SLO controller's budget is 512 and its floor 8. TPOT stays over the target at "
        "every decision and every step used the whole budget. After how many decisions does the "
        "budget first sit at the floor? (Each move multiplies by 0.75 and rounds down, never "
        "below the floor.)", _decisions_to_floor, rtol=0, atol=0.01,
        hint="play the decisions one by one as section 2 describes them; the rounding down "
             "matters on the way to the floor")
numeric("08.12", "A model keeps K and V in fp16 for 24 layers, 4 KV heads of 96 dims, in blocks of "
        "32 tokens. How many blocks does a host tier of kv_offloading_size=0.3 GiB hold?",
        _tier_blocks, rtol=0, atol=0.01,
        hint="one block holds K and V for every layer, KV head, dim and token of the block; check "
             "which gigabyte the flag counts in, and count only whole blocks")
numeric("08.13", "Restoring one block of SmolLM2-135M (section 4's: fp32, 16 tokens) from the host "
        "tier copies it at 8 GB/s (1e9 bytes); "
        "recomputing it is a prefill of its 16 tokens at 0.27 GFLOP per token (about 2 x the "
        "parameters) on a machine doing 50 GFLOP/s. How many times longer does the recompute take?",
        _recompute_over_restore, rtol=0.01,
        hint="time each side on its own: the copy is limited by the bandwidth, the prefill "
             "by the FLOP rate; the block holds K and V of 30 layers, 3 KV heads of 64 dims")
