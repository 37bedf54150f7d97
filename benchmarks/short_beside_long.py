"""`python -m benchmarks short_beside_long`: one short request beside one long prompt, over HTTP,
with prompt chunks sized in tokens and sized in time (SmolLM2-135M, `python -m minillm serve`).

One server per configuration, on a free loopback port. Per round: a long prompt (`--long-tokens`,
default 7600 of the chapters' text, near SmolLM2's 8192-token context) is sent, and `--delay`
seconds later (default 3) a short one ("Hello, my name is", 8 tokens, greedy, streamed): its
time to first token and to its last, the long request's end, and the load average before and
after. Configurations, run in turn each round (so a neighbour's load slows both alike):
- `tokens`: the server's defaults with `--prefill-step-target-ms 0` (chunks of
  long_prefill_token_threshold tokens: the order before the pacer);
- `paced`: the server's defaults (cli.SERVER_DEFAULTS, the pacer on at its default target);
- `paced_<ms>` for every `--targets` value: the defaults at that target (how the default was chosen).
`--load N` starts N bounded load processes beside the server (each a 2-thread torch matmul loop
under `timeout`, stopped at the end): "at load ~5" on a 2-core CPU.

Left out on purpose: many short requests (serve.py's load generator does rates), GPUs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.records import write_result
from benchmarks.server_process import child_env, free_port, server_process
from minillm.serve.cli import SERVER_DEFAULTS

SHORT = "Hello, my name is"
LOAD_LOOP = ("import torch; torch.set_num_threads(2); a = torch.randn(512, 512)\n"
             "while True: a = torch.tanh(a @ a)")
UNITS = {"*_s": "seconds of wall clock (client side)", "load_avg": "/proc/loadavg 1, 5, 15 min",
         "long_tokens": "tokens"}


def long_ids(n: int) -> list[int]:
    from benchmarks.lockout import long_prompt
    from minillm.model.loading import load_tokenizer
    return long_prompt(load_tokenizer(), n)


def one_round(url: str, model: str, ids: list[int], delay: float, max_tokens: int = 8) -> dict:
    import httpx
    res = {}

    def send_long():
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                       "temperature": 0}, timeout=1800)
        r.raise_for_status()
        res["long_s"] = time.perf_counter() - t
    load_before = os.getloadavg()
    thread = threading.Thread(target=send_long)
    thread.start()
    time.sleep(delay)
    t0, ttft, text = time.perf_counter(), None, ""
    body = {"model": model, "prompt": SHORT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = "".join(c.get("text", "") for c in json.loads(line[6:])["choices"])
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
    total = time.perf_counter() - t0
    thread.join()
    return {"short_ttft_s": ttft, "short_total_s": total, "short_text": text,
            "long_s": res.get("long_s"), "load_avg": {"before": load_before, "after": os.getloadavg()}}


def start_load(n: int, seconds: int) -> list:
    return [subprocess.Popen(["timeout", str(seconds), sys.executable, "-c", LOAD_LOOP],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def run(long_tokens: int = 7600, rounds: int = 2, delay: float = 3.0, load: int = 0,
        targets=(), out_dir=None, name: str = "short_beside_long") -> dict:
    configs = {"tokens": ["--prefill-step-target-ms", "0"], "paced": []}
    configs.update({f"paced_{t:g}": ["--prefill-step-target-ms", str(t)] for t in targets})
    ids = long_ids(long_tokens)
    runs = {k: {"flags": v, "rounds": []} for k, v in configs.items()}
    loaders = start_load(load, 3600) if load else []
    try:
        with tempfile.TemporaryDirectory(prefix="minillm-short-long-") as logs:
            for _ in range(rounds):
                for cname, flags in configs.items():
                    port = free_port()
                    argv = [sys.executable, "-m", "minillm", "serve", "--port", str(port), *flags]
                    url = f"http://127.0.0.1:{port}"
                    with server_process(argv, url + "/health", Path(logs) / f"{cname}.log"):
                        one_round(url, "smollm2-135m", ids[:64], 0.5)      # warm: first steps
                        row = one_round(url, "smollm2-135m", ids, delay)
                    runs[cname]["rounds"].append(row)
                    print(f"{cname:12s} short ttft {row['short_ttft_s']:.2f} s, total "
                          f"{row['short_total_s']:.2f} s; long {row['long_s']:.1f} s; load "
                          f"{row['load_avg']['before'][0]:.1f} -> {row['load_avg']['after'][0]:.1f}",
                          flush=True)
    finally:
        for p in loaders:
            p.terminate()
            p.wait()
    payload = {"long_tokens": long_tokens, "delay_s": delay, "load_processes": load,
               "rounds": rounds, "server_defaults": SERVER_DEFAULTS, "configs": runs, "units": UNITS,
               "thread_env": {k: child_env()[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
    path = write_result(name, payload, device="cpu", out_dir=out_dir)
    print("record:", path)
    return payload


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks short_beside_long")
    p.add_argument("--long-tokens", type=int, default=7600)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--delay", type=float, default=3.0, help="seconds between the long and the short")
    p.add_argument("--load", type=int, default=0, help="bounded load processes beside the server")
    p.add_argument("--targets", type=float, nargs="*", default=[], help="more pacer targets (ms)")
    p.add_argument("--name", default="short_beside_long", help="record name (e.g. ..._loaded)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    return run(a.long_tokens, a.rounds, a.delay, a.load, a.targets, a.out, a.name)


if __name__ == "__main__":
    main()
