"""Chapter 8's exercises (serving over HTTP). Keys "08.N" as numbered in the notebook.

08.1 is judged against Little's law on the numbers in its question; the code exercises run the
reader's function on inputs made when they check: Prometheus' histogram quantile (08.2, against a
plain implementation here, on histograms filled by `serve.metrics.Histogram`) and the text of a
streamed chat answer (08.3, on event streams written by `serve.protocol` with interleaved
completions, multi-byte characters and a usage chunk).
"""
import json
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
    from minillm.serve.metrics import Histogram
    rng = random.Random(seed)
    for n, scale in ((50, 0.1), (400, 1.5), (7, 30.0), (1000, 0.02)):
        h = Histogram("x", "x")
        for _ in range(n):
            h.observe(rng.lognormvariate(0, 1) * scale)
        cum, running = [], 0
        for c in h.counts:
            running += c
            cum.append(running)
        yield list(h.buckets) + [float("inf")], cum


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
    from minillm.engine.sequence import SamplingParams
    from minillm.serve.protocol import GenRequest, chunk, usage_chunk
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


numeric("08.1", "A server receives 3 requests per second on average, and a request spends 4 s on "
        "average between arriving and its last token. How many requests are inside the server "
        "(waiting or running) on average?", lambda: 3 * 4, rtol=1e-6,
        hint="Little's law: L = lambda * W")
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
