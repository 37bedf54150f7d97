"""The course in one sitting: every record the chapters quote, then every notebook and the demo, run one
after another on one machine with one thread policy, the load average taken before and after each.

    python -m benchmarks sitting                     # records, then notebooks (stored outputs and figures/)
    python -m benchmarks sitting --no-records        # the notebooks only
    python -m benchmarks sitting --size              # only count the course (words, code, figures, minutes)
    python -m benchmarks sitting --append --records serve_compare --notebooks 08_serving.ipynb
                                                     # finish a sitting: add items to its record

The notebooks are executed in place (their stored outputs are replaced) with MINILLM_FIGURES_DIR
pointed at figures/, so the committed figures come from the same run. The record
`sitting_<device>.json` holds, for each item, its wall time and the load before and after, and the
course's size: prose words, code lines and figures per notebook, and an estimate of the time to
read, run and think through it (80 words and 8 code lines a minute, rounded to 5 minutes; the
exercises not counted). The README's reading times come from it.

Left out of the default list on purpose: the records that start servers of their own
(`serve_compare`, `disaggregation`: their commands are printed; name them in `--records` to take
them in the sitting), `kernels` (chapter 1b sets the records of two other CPUs side by side, so
it is re-taken on the machine it names, with `--threads 2`), and `make test`'s nbval run (a
sitting writes the outputs that nbval then compares).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.records import REPO_ROOT, write_result

# the records the chapters quote, in chapter order (each a `python -m benchmarks NAME` run)
RECORDS = ["serving", "lockout", "spec", "quant", "priority", "spec_switch", "slo_control",
           "kv_tier", "attention", "attention_decode", "drafting", "parallel"]
BY_HAND = {
    "serve_compare": "python -m benchmarks serve_compare   (starts minillm and `transformers serve`)",
    "disaggregation": "python -m benchmarks disaggregation (colocated and disaggregated servers)",
}
WORDS_PER_MIN, CODE_LINES_PER_MIN = 80, 8


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def notebook_size(path: Path) -> dict:
    """Prose words, code lines and figures (stored PNG outputs) of one notebook, and the minutes."""
    cells = json.loads(path.read_text())["cells"]
    words = sum(len(re.findall(r"[A-Za-z0-9][\w'.,/-]*", "".join(c["source"])))
                for c in cells if c["cell_type"] == "markdown")
    code = sum(1 for c in cells if c["cell_type"] == "code"
               for line in "".join(c["source"]).splitlines() if line.strip() and not line.strip().startswith("#"))
    figures = sum(1 for c in cells for o in c.get("outputs", []) if "image/png" in (o.get("data") or {}))
    minutes = words / WORDS_PER_MIN + code / CODE_LINES_PER_MIN
    return {"notebook": path.name, "words": words, "code_lines": code, "figures": figures,
            "minutes": int(5 * max(1, round(minutes / 5)))}


def course_size(notebooks=None) -> list[dict]:
    paths = notebooks or sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    return [notebook_size(Path(p)) for p in paths]


def _run(label: str, cmd: list[str], env: dict, log: list) -> bool:
    before, t0 = _load(), time.perf_counter()
    print(f"[sitting] {label} ... (load {before})", flush=True)
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ok = done.returncode == 0
    log.append({"item": label, "ok": ok, "wall_s": round(wall, 1), "load_before": before, "load_after": _load()})
    print(f"[sitting] {label}: {'ok' if ok else 'FAILED'} in {wall:.0f} s (load {_load()})", flush=True)
    if not ok:
        print((done.stdout + done.stderr)[-3000:], flush=True)
    return ok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks sitting", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-records", action="store_true", help="skip the records, run the notebooks only")
    ap.add_argument("--no-notebooks", action="store_true", help="run the records only")
    ap.add_argument("--records", nargs="*", default=None,
                    help=f"which records (default: {' '.join(RECORDS)}; also {' '.join(BY_HAND)})")
    ap.add_argument("--notebooks", nargs="*", default=None,
                    help="which notebooks, by file name (default: all of them, then the demo)")
    ap.add_argument("--append", action="store_true",
                    help="add this run's items to the existing sitting record instead of replacing it")
    ap.add_argument("--size", action="store_true", help="only print the course's size and reading times")
    args = ap.parse_args(argv)
    size = course_size()
    if args.size:
        for s in size:
            print(f"{s['notebook']:<38} {s['words']:>6} words {s['code_lines']:>4} code lines "
                  f"{s['figures']:>2} figures  ~{s['minutes']} min")
        print(f"{'total':<38} {sum(s['words'] for s in size):>6} words, ~{sum(s['minutes'] for s in size) / 60:.1f} h")
        return
    names = {s["notebook"] for s in size}      # bad arguments fail before an hour of records, not after
    unknown = sorted(set(args.notebooks or ()) - names)
    if unknown:
        raise ValueError(f"--notebooks: no such notebook {', '.join(unknown)}; choose from {', '.join(sorted(names))}")
    from benchmarks.records import results_dir, device_tag
    record_path = results_dir() / f"sitting_{device_tag('cpu')}.json"
    if args.append and not record_path.is_file():
        raise ValueError(f"--append: there is no sitting record to add to ({record_path})")
    import torch
    from minillm.lab.machine import COURSE_THREADS
    torch.set_num_threads(COURSE_THREADS)     # the record's metadata names the policy its runs used
    env = dict(os.environ, MINILLM_FIGURES_DIR=str(REPO_ROOT / "figures"), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("OMP_NUM_THREADS", None)
    py = sys.executable
    log, start = [], _load()
    if not args.no_records:
        for name in (RECORDS if args.records is None else args.records):
            _run(f"record {name}", [py, "-m", "benchmarks", name], env, log)
        for name, cmd in BY_HAND.items():
            if name not in (args.records or ()):
                print(f"[sitting] not run here ({name}): {cmd}")
    if not args.no_notebooks:
        jupyter = str(Path(py).parent / "jupyter")
        for s in size:
            if args.notebooks is not None and s["notebook"] not in args.notebooks:
                continue
            _run(f"notebook {s['notebook']}", [jupyter, "nbconvert", "--to", "notebook", "--execute", "--inplace",
                                                "--ExecutePreprocessor.timeout=1200", f"notebooks/{s['notebook']}"],
                 env, log)
        size = course_size()      # the stored figures are counted from the new outputs
        if args.notebooks is None:
            _run("demo (its figures)", [py, "-m", "minillm", "demo"], env, log)
    earlier = []
    if args.append:               # the record's earlier part(s) first, with the machine each ran on
        old = json.loads(record_path.read_text())
        start = old["load_at_start"]
        earlier = old.get("earlier_parts", []) + [{"machine": old["machine"], "items": len(old["items"])}]
        log = old["items"] + log
    path = write_result("sitting", {"load_at_start": start, "load_at_end": _load(), "items": log,
                                    "earlier_parts": earlier, "course": size, "by_hand": BY_HAND,
                                    "units": {"minutes": f"{WORDS_PER_MIN} prose words and {CODE_LINES_PER_MIN} "
                                                         "code lines a minute, rounded to 5; exercises not counted"}})
    print(f"[sitting] wrote {path}; {sum(not x['ok'] for x in log)} failed of {len(log)}")


if __name__ == "__main__":
    main()
