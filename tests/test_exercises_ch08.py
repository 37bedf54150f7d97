"""Chapter 8's exercise checks accept a right answer written here from the rules and reject wrong ones."""
import json

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
