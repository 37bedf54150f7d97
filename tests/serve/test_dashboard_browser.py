"""`GET /dashboard` in a real headless browser (Debian's chromium, driven by selenium through the
installed chromedriver: minillm/lab/dashboard.py has the flags). A tiny model's server with
priority classes takes a load (concurrent completions and one streamed chat) while the page
polls; once the load is over and /metrics has settled, every number the page shows from /metrics
equals the value /metrics gives at that moment, every chart has drawn its lines (coloured pixels
on the canvas), the page's percentile is Prometheus' `histogram_quantile`, and the browser
console holds no error.

Without chromium, chromedriver or selenium the module is skipped, saying which is missing;
with MINILLM_REQUIRE_BROWSER=1 (CI: .ci/run installs the browser) it fails instead.
"""
import itertools
import math
import os
import random
import threading
import time

import httpx
import pytest

from minillm.engine.policies.priority import SEED_CLASSES
from minillm.lab import dashboard as page
from minillm.serve import running
from serve_tiny import MODEL, chat, completion, scrape, settled, settles, sse_lines, tiny_llm  # noqa: F401

WHY = page.missing()
if WHY and os.environ.get("MINILLM_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"MINILLM_REQUIRE_BROWSER=1 but no browser can run: {WHY}")
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no headless browser: {WHY}")

# How many coloured (non-grey) pixels a chart must have to count as drawn: a line across the
# window is hundreds; axes, grid and labels are grey.
MIN_LINE_PIXELS = 30
_COLOURED = """
return [...document.querySelectorAll("canvas")].map(c => {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    const hi = Math.max(d[i], d[i + 1], d[i + 2]), lo = Math.min(d[i], d[i + 1], d[i + 2]);
    if (hi - lo > 60) n++;
  }
  return {title: c.parentElement.querySelector("h3").textContent, points: Number(c.dataset.points), coloured: n};
});
"""


@pytest.fixture(scope="module")
def srv(tok):
    llm = tiny_llm(tok, scheduling_policy="priority", priority_classes=SEED_CLASSES)
    with running(llm, served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def driver():
    with page.browser() as d:
        yield d


def load(srv) -> None:
    """Six completions at two priorities, four at a time, and one streamed chat."""
    def one(i):
        r = httpx.post(srv.base_url + "/completions", timeout=60,
                       json=completion(f"Count to {i}:", max_tokens=6, priority=2 * (i % 2),
                                       ignore_eos=True))
        assert r.status_code == 200, r.text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads[:4]:
        t.start()
    with httpx.stream("POST", srv.base_url + "/chat/completions", timeout=60,
                      json=chat("Hi", max_tokens=8, stream=True, priority=1, ignore_eos=True)) as r:
        assert r.status_code == 200 and sse_lines(r)[-1] == "data: [DONE]"
    for t in threads[4:]:
        t.start()
    for t in threads:
        t.join()


def expected(metrics: dict, name: str, labels: dict):
    """What the page must show for `name` with `labels`: the sum of the matching samples of one
    scrape (None when there is none, shown as a dash)."""
    want = set(labels.items())
    hits = [v for (n, ls), v in metrics.items() if n == name and want <= set(ls)]
    return sum(hits) if hits else None


def test_the_page_shows_what_metrics_says_and_draws_it(srv, driver):
    driver.get(srv.url + "/dashboard?poll_ms=250&rate_s=2&window_s=10")
    page.wait_polls(driver, 1)
    load(srv)
    settled(srv.url)                                     # nothing runs: the counts stand still
    polls = page.snapshot(driver)["polls"]
    assert page.wait_polls(driver, polls + 2) >= polls + 2
    snap, metrics = page.snapshot(driver), scrape(srv.url)
    raw = [n for n in snap["numbers"] if not n["derived"]]
    assert len(raw) >= 30 and {n["metric"] for n in raw} >= {
        "minillm:generation_tokens_total", "minillm:request_success_total",
        "minillm:num_requests_running_by_priority", "minillm:slo_max_num_batched_tokens",
        "minillm:kv_cache_blocks_cached", "minillm:spec_decode_num_draft_tokens_total"}
    for n in raw:
        want, shown = expected(metrics, n["metric"], n["labels"]), page.shown_value(n["text"])
        assert (shown is None) == (want is None), n
        if want is not None:
            assert shown == pytest.approx(want, rel=1e-3, abs=1e-12), n
    assert expected(metrics, "minillm:request_success_total", {}) == 7
    assert expected(metrics, "minillm:generation_tokens_total", {}) == 6 * 6 + 8
    for n in snap["numbers"]:                            # derived: a number or a dash, nothing else
        assert n["text"] == "\u2014" or math.isfinite(float(n["text"])), n

    charts = {c["title"]: c for c in driver.execute_script(_COLOURED)}
    for title in ("requests / s", "output tokens / s", "TTFT (s)", "TPOT (s)", "ITL (s)",
                  "running and waiting", "KV blocks (device)", "SLO controller: token budget"):
        assert charts[title]["points"] > 1 and charts[title]["coloured"] >= MIN_LINE_PIXELS, charts[title]
    assert len(charts) == 12

    kept = driver.execute_script("return [scrapes.length, scrapes.filter(s => s.samples).length];")
    assert kept[1] <= min(kept[0], math.ceil(2 * 1000 / 250) + 3)   # older scrapes keep their values only

    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def _prometheus_quantile(q: float, les: list[float], counts: list[float]) -> float:
    """promql/quantile.go's bucketQuantile, transcribed: the reference for the page's percentile."""
    total = counts[-1]
    rank = q * total
    b = next((i for i in range(len(les) - 1) if counts[i] >= rank), len(les) - 1)
    if b == len(les) - 1:
        return les[-2]
    start, end, count = 0.0, les[b], counts[b]
    if b > 0:
        start, count, rank = les[b - 1], counts[b] - counts[b - 1], rank - counts[b - 1]
    return start + (end - start) * (rank / count)


def test_the_page_percentile_is_prometheus_histogram_quantile(srv, driver):
    if "dashboard" not in driver.current_url:
        driver.get(srv.url + "/dashboard")
    les = [0.001, 0.01, 0.1, 1.0, 10.0, math.inf]
    gen = random.Random(0)
    for _ in range(40):
        counts = list(itertools.accumulate(gen.choice((0, 0, 1, 3, 10)) for _ in les))
        if counts[-1] == 0:
            continue
        for q in (0.5, 0.9, 0.95, 0.99):
            got = driver.execute_script(
                "return histogramQuantile(arguments[0], arguments[1].map(x => x === 'inf' ? Infinity : x),"
                " arguments[2]);", q, [x if x != math.inf else "inf" for x in les], counts)
            assert got == pytest.approx(_prometheus_quantile(q, les, counts), rel=1e-12), (q, counts)
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def test_the_lab_helpers_read_the_page_and_take_a_screenshot(srv, tmp_path):
    """What the notebook calls: read_page's numbers are /metrics' (the load is over), and the
    screenshot is a PNG."""
    shown, metrics = page.read_page(srv.url + "/dashboard?poll_ms=200"), scrape(srv.url)
    assert shown["minillm:generation_tokens_total"] == expected(metrics, "minillm:generation_tokens_total", {})
    assert shown['minillm:num_requests_waiting_by_priority{priority="2"}'] == 0
    path = page.screenshot(srv.url + "/dashboard", tmp_path / "dashboard.png", wait_s=0.3)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
