"""The server's live dashboard (`GET /dashboard`, serve/dashboard.py) seen through a real browser:
Debian's headless `chromium`, driven by selenium through the installed `chromedriver` (selenium
never downloads a browser or a driver here).

    from minillm.lab.dashboard import read_page, screenshot
    screenshot(srv.url + "/dashboard", "figures/dashboard.png")   # a PNG of the page after it polled
    read_page(srv.url + "/dashboard")  # {"minillm:generation_tokens_total": 120.0, ...}

`read_page` returns what the page shows, keyed like Prometheus' text format: the metric's name,
with its labels when the number is one labelled sample (`minillm:request_success_total
{finished_reason="length"}`); derived numbers (rates, percentiles) are left out, and a number the
page shows as a dash (no sample yet) is None. `snapshot(driver)` is the same read on an open page,
with every number's attributes, for tests.

The browser runs with the flags a root user on a machine without network needs (no sandbox, no
GPU, nothing phoning home) and a fresh profile in a temporary folder. Without chromium,
chromedriver or selenium, `BrowserMissing` says which is missing and how to install it.

Left out on purpose: other browsers, and pages of other servers (any URL works, but the numbers
are read by the dashboard's own `data-metric` attributes).
"""
import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")
_SNAPSHOT = """
const status = document.getElementById("status");
return {polls: Number(status ? status.dataset.polls : 0), numbers: [...document.querySelectorAll("[data-metric]")].map(
  el => ({metric: el.dataset.metric, labels: el.dataset.labels ? JSON.parse(el.dataset.labels) : {},
          derived: el.dataset.derived || null, text: el.textContent}))};
"""


class BrowserMissing(RuntimeError):
    """No headless browser to drive: the message says what is missing and how to install it."""


def missing() -> str | None:
    """Why no browser can run here (None when chromium, chromedriver and selenium are all there)."""
    gone = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if gone:
        return f"{' and '.join(gone)} missing: apt-get install -y chromium chromium-driver"
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (it comes with the dev extra: pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def browser(width: int = 1400, height: int = 1800):
    """A headless chromium (a selenium WebDriver) with the browser console logged; quit on exit."""
    why = missing()
    if why:
        raise BrowserMissing(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="minillm-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def snapshot(driver) -> dict:
    """{"polls": scrapes so far, "numbers": [{metric, labels, derived, text}]}, read in one script
    (so all of it is from the same poll)."""
    return driver.execute_script(_SNAPSHOT)


def wait_polls(driver, at_least: int, timeout_s: float = 30.0) -> int:
    """Wait until the page has scraped /metrics `at_least` times; returns the count."""
    deadline = time.monotonic() + timeout_s
    while True:
        polls = snapshot(driver)["polls"]
        if polls >= at_least or time.monotonic() > deadline:
            return polls
        time.sleep(0.05)


def shown_value(text: str) -> float | None:
    """A number as the page prints it -> float (a dash: no sample -> None)."""
    return None if text.strip() in ("\u2014", "") else float(text)


def sample_key(metric: str, labels: dict) -> str:
    if not labels:
        return metric
    return metric + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def read_page(url: str, polls: int = 2, timeout_s: float = 30.0) -> dict:
    """{metric (with labels, if any): the value the page shows} once it has polled `polls` times."""
    with browser() as driver:
        driver.get(url)
        wait_polls(driver, polls, timeout_s)
        return {sample_key(n["metric"], n["labels"]): shown_value(n["text"])
                for n in snapshot(driver)["numbers"] if not n["derived"]}


def screenshot(url: str, path, wait_s: float = 3.0, width: int = 1400, height: int = 1800) -> str:
    """Open the dashboard, let it poll for `wait_s` seconds, save a PNG at `path`; returns it."""
    with browser(width, height) as driver:
        driver.get(url)
        wait_polls(driver, 1)
        time.sleep(wait_s)
        driver.save_screenshot(str(path))
    return str(path)


def metrics_samples(url: str) -> list[tuple[str, dict, float]]:
    """Every sample of the server's `/metrics` now: (name, labels, value), parsed by
    prometheus_client's own parser. `url` is the server's root (no /v1)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def expected_value(samples, key: str) -> float | None:
    """What the page must show for `key` (as `read_page` names it: a metric, maybe with labels):
    the sum of the matching samples (a number with fewer labels adds up the rest), None if none."""
    name, _, rest = key.partition("{")
    want = {}
    for part in filter(None, rest.rstrip("}").split(",")):
        k, v = part.split("=", 1)
        want[k] = json.loads(v)
    hits = [v for n, labels, v in samples if n == name and want.items() <= labels.items()]
    return sum(hits) if hits else None


def compare_page(url: str, polls: int = 2) -> list[tuple[str, float | None, float | None]]:
    """[(key, shown on the page, in /metrics)] for every raw number of the dashboard at `url`
    (a page URL: .../dashboard), read once the page has polled `polls` times, /metrics right
    after; call it when nothing runs, so the counts stand still between the two reads."""
    shown = read_page(url, polls)
    samples = metrics_samples(url.split("/dashboard", 1)[0])
    return [(k, v, expected_value(samples, k)) for k, v in shown.items()]
