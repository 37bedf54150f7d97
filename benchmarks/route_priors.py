"""`python -m benchmarks route_priors [--check]`: the package's untimed route guesses, from the records.

Reads every committed record that holds a tuned CPU route table (`kernels`, `first_start`) or
batch-1 decode times per pinned route (a `kernels` record reported without its table), and writes
minillm/kernels/route_priors.json: per CPU vendor, instruction set and thread class, the route
that won on most weight shapes in each row bucket, and the layout most shapes chose (see
`minillm.kernels.route_priors`). `--check` writes nothing and exits 1 when the committed file
differs from what the records give (tests/kernels/test_route_priors.py runs the same comparison).
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from minillm.kernels.cpu_kernels import BUCKETS, LAYOUT_OF
from minillm.kernels.route_priors import thread_class, vendor_of
from minillm.lab.common import load_results

PRIORS_FILE = Path(__file__).resolve().parents[1] / "minillm" / "kernels" / "route_priors.json"
SINGLE_COPY = ("F.linear", "x@W", "ksplit", "nsplit", "onednn", "onednn_io")   # no second copy


def _tables(record: dict) -> list[dict]:
    """The parts of a record that hold a route table or decode times per route: the record
    itself (`kernels`), or each thread count's tuned process (`first_start`)."""
    if record.get("benchmark") == "first_start":
        return [{"machine": record["machine"], "kernels": run["tuned"]["tuned_report"]}
                for run in record.get("runs", []) if run.get("tuned", {}).get("tuned_report")]
    return [record]


def _votes(record: dict):
    """(vendor, isa or None, thread class, {bucket: Counter of routes}, Counter of layouts), or None."""
    m = record.get("machine") or {}
    if m.get("device", "cpu") != "cpu":
        return None
    report = record.get("kernels") or {}
    key = report.get("key") or {}
    threads = key.get("threads") or m.get("torch_threads") or 1
    isa = (key.get("isa") or {}).get("aten")
    buckets, layouts = {b: Counter() for b in BUCKETS}, Counter()
    plan = report.get("plan") if report.get("source", "tuned") == "tuned" else None
    if plan:
        for p in plan.values():
            layouts[p["layout"]] += 1
            for b, route in p["routes"].items():
                buckets[int(b)][route] += 1
    else:                                       # decode times per pinned route: bucket 1 only
        decode = {r: t for r, t in (record.get("decode_ms_per_token") or {}).items() if r in SINGLE_COPY}
        if not decode:
            return None
        best = min(decode, key=decode.get)
        buckets[1][best] += 1
        layouts[LAYOUT_OF[best]] += 1
    return vendor_of(key.get("cpu") or m.get("cpu", "")), isa, thread_class(threads), buckets, layouts


def build(records: list[dict]) -> dict:
    """{"priors": [...]} from records (see the module text); sorted, so the file is stable."""
    groups: dict = {}
    for rec in (part for r in records for part in _tables(r)):
        v = _votes(rec)
        if v is None:
            continue
        vendor, isa, tc, buckets, layouts = v
        g = groups.setdefault((vendor, isa or "", tc), {"buckets": {b: Counter() for b in BUCKETS},
                                                        "layouts": Counter(), "from": []})
        for b, c in buckets.items():
            g["buckets"][b].update(c)
        g["layouts"].update(layouts)
        m = rec["machine"]
        g["from"].append(f"{m.get('cpu')}, {m.get('date')}")
    priors = []
    for (vendor, isa, tc), g in sorted(groups.items()):
        layout = max(sorted(g["layouts"]), key=g["layouts"].get)     # ties: alphabetical, stable
        routes, last = {}, "F.linear"
        for b in BUCKETS:
            on = Counter({r: n for r, n in g["buckets"][b].items() if LAYOUT_OF.get(r) == layout})
            last = max(sorted(on), key=on.get) if on else last        # no vote: the bucket below's
            routes[str(b)] = last
        priors.append({"vendor": vendor, "isa": isa or None, "threads": tc, "layout": layout,
                       "routes": routes, "from": sorted(set(g["from"]))})
    return {"about": "written by `python -m benchmarks route_priors` from benchmarks/results/; "
                     "see minillm/kernels/route_priors.py", "priors": priors}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks route_priors", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = p.parse_args(argv)
    want = build(load_results())
    text = json.dumps(want, indent=1) + "\n"
    if args.check:
        same = PRIORS_FILE.is_file() and json.loads(PRIORS_FILE.read_text()) == want
        print("route_priors.json matches the records" if same else "route_priors.json is stale: "
              "run python -m benchmarks route_priors")
        sys.exit(0 if same else 1)
    PRIORS_FILE.write_text(text)
    print(f"wrote {PRIORS_FILE} ({len(want['priors'])} entries)")
    for e in want["priors"]:
        print(f"  {e['vendor']} {e['isa'] or '(isa not recorded)'}, threads {e['threads']}: "
              f"{e['layout']}, " + " ".join(f"{b}:{r}" for b, r in e["routes"].items()))


if __name__ == "__main__":
    main()
