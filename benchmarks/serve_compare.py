"""`python -m benchmarks serve_compare`: minillm's server against `transformers serve
--continuous-batching`, same model, same client, same load, one after the other on this machine.

Each server runs as a subprocess on a free loopback port (`server_process`): started, waited for
(/health), warmed up with a short unrecorded burst, then loaded at request rate inf (everything at
once: saturation) and at fractions of the *first* server's saturation request rate, and stopped.
transformers serve gets an HF-format copy of the same weights (`save_hf_folder`, built once).

The two targets of issue 17 are computed from the runs, never asserted: minillm's output tokens/s
at saturation over transformers' (target >= 1.5), and both TTFT p99 at half of minillm's
saturation rate (target: minillm's no worse). The record `serve_compare_cpu.json` holds both
servers' full summaries, their command lines and the targets; a latency-vs-load figure sits beside.

Defaults: HumanEval prompts on /v1/completions (code rarely ends before 32 tokens, and transformers
serve refuses vLLM's `ignore_eos`; both servers answer greedily, so both emit the same tokens),
24 prompts, 32 tokens, fractions 0.5 1.0: about 10 minutes on 2 loaded CPU cores, most of it
transformers serve's (it stays saturated at every rate). The committed record added 0.25
(`--fractions 0.25 0.5 1.0`, 14.5 minutes).

Read one run with care: on a loaded 2-core CPU, transformers serve's speed on the same load swung
between about 5 and 55 output tokens/s from run to run (multi-second decode steps in its slow
runs), so the ratio of one comparison is not a constant of the two servers; repeat it.

Left out on purpose: vLLM (documented in chapter 8, not run here), repeated trials.
"""
import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from minillm.lab.loadgen import benchmark, jsonable, sweep, sweep_table
from benchmarks.server_process import free_port, server_process

SERVERS = ("minillm", "transformers")
MINILLM_NAME = "smollm2-135m"


def transformers_cli() -> str:
    here = Path(sys.executable).parent / "transformers"
    found = str(here) if here.is_file() else shutil.which("transformers")
    if not found:
        raise FileNotFoundError("the `transformers` command is missing; pip install 'transformers[serving]'")
    from transformers.utils.import_utils import is_serve_available
    if not is_serve_available():       # checked here, not after minillm's half of the run
        raise ImportError("`transformers serve` needs its serving extra (fastapi, uvicorn, pydantic, openai): "
                          "pip install '.[compare]' in this checkout")
    return found


def server_command(kind: str, port: int, device: str, hf_folder: Path, extra=()) -> tuple[list[str], str]:
    """(argv, the model name its /v1/models lists) for one server on 127.0.0.1:port."""
    if kind == "minillm":
        return ([sys.executable, "-m", "minillm", "serve", "--model", MINILLM_NAME, "--host", "127.0.0.1",
                 "--port", str(port), "--served-model-name", MINILLM_NAME, *extra], MINILLM_NAME)
    if kind == "transformers":
        return ([transformers_cli(), "serve", "--continuous-batching", "--device", device,
                 "--host", "127.0.0.1", "--port", str(port), *extra, str(hf_folder)], str(hf_folder))
    raise ValueError(f"server must be one of {', '.join(SERVERS)}, got {kind!r}")


def hf_folder_ready(folder: Path | None) -> Path:
    from minillm.model.loading import cache_dir
    folder = Path(folder) if folder else cache_dir() / "smollm2-135m-hf"
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        from benchmarks.hf_folder import save_hf_folder
        save_hf_folder(folder)
    return folder


def sweep_one(kind: str, rates: list[float] | None, fractions, load: dict, device: str,
              hf_folder: Path, extra, log_dir: Path) -> dict:
    """Start one server, warm it, run inf then the rates, stop it. `rates` None: derive them
    from this server's saturation rate (the first server). Runs: inf first, then `rates` order."""
    port = free_port()
    argv, model = server_command(kind, port, device, hf_folder, extra)
    url = f"http://127.0.0.1:{port}"
    with server_process(argv, url + "/health", log_dir / f"{kind}.log") as (_, startup_s):
        warm = dict(load, num_prompts=min(8, load["num_prompts"]), seed=load["seed"] + 1)
        benchmark(url + "/v1", model, **warm)                  # first requests compile / allocate
        rows = sweep(url + "/v1", model, fractions, rates, verbose=True, label=kind, **load)
    runs = [rows[-1], *rows[:-1]]                               # inf first: `targets` reads it there
    return {"command": shlex.join(argv), "startup_s": startup_s,
            "rates": [r["offered_rate"] for r in rows[:-1]], "runs": runs}


def targets(sweeps: dict, fractions) -> dict:
    """Issue 17's two targets from the runs (inf run first, then the rates in `fractions` order)."""
    if not {"minillm", "transformers"} <= set(sweeps) or 0.5 not in fractions:
        return {}
    def at(kind, i):
        return sweeps[kind]["runs"][i]["summary"]
    half = 1 + list(fractions).index(0.5)
    ratio = at("minillm", 0)["output_throughput"] / max(at("transformers", 0)["output_throughput"], 1e-9)
    ttft = {k: at(k, half)["ttft_ms"]["p99"] for k in ("minillm", "transformers")}
    return {"output_tok_s_ratio_at_saturation": ratio, "output_tok_s_ratio_target": 1.5,
            "output_tok_s_ratio_met": ratio >= 1.5, "ttft_p99_ms_at_half_saturation": ttft,
            "ttft_p99_met": ttft["minillm"] <= ttft["transformers"]}


def compare(servers=SERVERS, fractions=(0.5, 1.0), num_prompts: int = 24, max_tokens: int = 32,
            dataset: str = "humaneval", endpoint: str = "completions", max_concurrency=None,
            device: str = "cpu", hf_folder=None, extra: dict | None = None, out_dir=None,
            seed: int = 0) -> dict:
    """Run the comparison, write the record and figure, and return the record's payload."""
    fractions = tuple(sorted(fractions))                        # runs come back in rate order
    for kind in servers:
        server_command(kind, 0, device, Path("."))             # an unknown server fails before any run
    folder = hf_folder_ready(hf_folder) if "transformers" in servers else None
    load = {"dataset": dataset, "num_prompts": num_prompts, "max_tokens": max_tokens,
            "endpoint": endpoint, "max_concurrency": max_concurrency, "seed": seed}
    sweeps, rates = {}, None
    with tempfile.TemporaryDirectory(prefix="minillm-serve-compare-") as logs:
        for kind in servers:
            sweeps[kind] = sweep_one(kind, rates, fractions, load, device, folder,
                                     (extra or {}).get(kind, ()), Path(logs))
            rates = sweeps[kind]["rates"]
    from minillm.lab.serve_metrics import UNITS
    payload = {"units": UNITS, "servers": sweeps, "load": load, "fractions_of_first_saturation": list(fractions),
               "targets": targets(sweeps, fractions), "note": "loads run one server at a time"}
    _write(payload, out_dir)
    return payload


def _write(payload: dict, out_dir) -> None:
    from benchmarks.records import save_figure_beside, write_result
    from minillm.viz.plotting import use_headless_backend
    from minillm.viz.serve import latency_vs_load_plot
    use_headless_backend()
    path = write_result("serve_compare", jsonable(payload), device="cpu", out_dir=out_dir)
    order = {k: sorted(v["runs"], key=lambda r: r["offered_rate"]) for k, v in payload["servers"].items()}
    fig = latency_vs_load_plot({k: [r["summary"] for r in runs] for k, runs in order.items()})
    print("record:", path, "\nfigure:", save_figure_beside(fig, path, "serve_compare"))
    for kind, sweep_ in payload["servers"].items():
        print(f"{kind}: {sweep_['command']}\n{sweep_table(order[kind])}")
    print("targets:", payload["targets"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks serve_compare")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--fractions", nargs="+", type=float, default=[0.5, 1.0],
                   help="offered rates as fractions of the first server's saturation rate")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--endpoint", default="completions", choices=["chat", "completions"])
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--device", default="cpu", help="passed to transformers serve")
    p.add_argument("--hf-folder", default=None, help="default: <minillm cache>/smollm2-135m-hf")
    p.add_argument("--minillm-args", default="", help='extra flags, e.g. "--max-num-seqs 32"')
    p.add_argument("--transformers-args", default="", help='extra flags, e.g. "--cb-block-size 32"')
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if any(not f > 0 for f in a.fractions):
        p.error("--fractions must be > 0")
    extra = {"minillm": shlex.split(a.minillm_args), "transformers": shlex.split(a.transformers_args)}
    return compare(a.servers, tuple(a.fractions), a.num_prompts, a.max_tokens, a.dataset, a.endpoint,
                   a.max_concurrency, a.device, a.hf_folder, extra, a.out)
