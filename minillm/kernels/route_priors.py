"""The best guess that needs no timing: which routes won on CPUs like this one, elsewhere.

When the machine is too busy to time anything, a first start still has to pick routes. F.linear
is the safe choice but often the slowest (chapter 1's appendix: up to 1.6x a tuned table's decode
step). The committed benchmark records hold tuned tables from real machines; `route_priors.json`
(package data, written by `python -m benchmarks route_priors` from those records, and checked
against them by tests/kernels/test_route_priors.py) keeps, for each CPU vendor, instruction set and
thread count (one thread, or several: `ksplit` and `nsplit` need two), the route that won most
often per row bucket, and the layout most weight shapes chose.

`prior_plan(threads)` looks this CPU up: the same vendor, instruction set and thread class first,
then the same vendor and thread class, then the same vendor; no match is F.linear. Every route
computes x @ W^T, so a guess that is wrong for this CPU costs speed, never correctness.

Left out on purpose: guessing from CPU families or cache sizes, and priors for other dtypes.
"""
import json
import platform
from importlib import resources
from pathlib import Path

from minillm.kernels.cpu_kernels import BUCKETS, LAYOUT_OF, kernel_isa

VENDORS = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}
ONE_THREAD = {"ksplit": "x@W", "nsplit": "F.linear"}     # what a split route computes on one thread


def vendor_of(cpu: str) -> str:
    """A vendor from a CPU model string or a /proc/cpuinfo vendor id ("AMD", "Intel", "arm", or
    the string itself)."""
    if cpu in VENDORS:
        return VENDORS[cpu]
    for name in ("AMD", "Intel"):
        if name.lower() in cpu.lower():
            return name
    if any(arch in cpu.lower() for arch in ("arm", "aarch64", "apple")):
        return "arm"
    return cpu


def cpu_vendor() -> str:
    """This CPU's vendor (Linux /proc/cpuinfo's vendor id, else the machine's architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return vendor_of(line.split(":", 1)[1].strip())
    except OSError:
        pass
    return vendor_of(platform.machine())


def thread_class(threads: int) -> str:
    return "1" if threads <= 1 else "many"


def load_priors(path=None) -> list[dict]:
    """The committed priors: [{"vendor", "isa", "threads", "layout", "routes": {bucket: route},
    "from": [records]}]; [] when the file is missing or unreadable (then F.linear)."""
    try:
        text = Path(path).read_text() if path else \
            resources.files("minillm.kernels").joinpath("route_priors.json").read_text()
        return list(json.loads(text)["priors"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def find_prior(vendor: str, isa: str, threads: int, priors=None) -> dict | None:
    """The closest prior entry for this CPU (see the module text), or None."""
    priors = load_priors() if priors is None else priors
    tc = thread_class(threads)
    for want in ({"vendor": vendor, "isa": isa, "threads": tc}, {"vendor": vendor, "threads": tc},
                 {"vendor": vendor}):
        hits = [p for p in priors if all(p.get(k) == v for k, v in want.items())]
        if hits:
            return hits[0]
    return None


def prior_plan(threads: int, priors=None) -> tuple[dict, str]:
    """({"layout", "routes": {bucket: route}}, where it came from, in words) for this CPU."""
    entry = find_prior(cpu_vendor(), kernel_isa()["aten"], threads, priors)
    if entry is None or entry.get("layout") not in ("out_in", "in_out"):
        return ({"layout": "out_in", "routes": {b: "F.linear" for b in BUCKETS}},
                f"no committed record for a {cpu_vendor()} CPU: F.linear")
    routes = {b: entry["routes"].get(str(b), "F.linear") for b in BUCKETS}
    if threads <= 1:            # a split over one thread is the plain product on the same layout
        routes = {b: ONE_THREAD.get(r, r) for b, r in routes.items()}
    routes = {b: r if LAYOUT_OF.get(r) == entry["layout"] else "F.linear" for b, r in routes.items()}
    chosen = ", ".join(sorted(set(routes.values())))
    return ({"layout": entry["layout"], "routes": routes},
            f"the routes that won most often on {entry['vendor']} {entry.get('isa') or ''} CPUs at "
            f"{'1 thread' if entry['threads'] == '1' else 'several threads'} in the committed "
            f"records ({chosen})".replace("  ", " "))
