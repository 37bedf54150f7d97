"""`python -m benchmarks lockout`: short requests behind a long prompt's prefill, with the
partial-prefill knobs off and on (SmolLM2-135M, the in-process engine, greedy).

One long prompt (`--long-tokens`, default 4096 tokens of the chapters' text; the review that found
the lock-out used 8160) starts prefilling alone; four short prompts (chat prompts of 10-20 tokens)
arrive when the long one has computed 10%, 35%, 60% and 85% of its prompt, so they arrive at the
same point of its prefill whatever the configuration. Every request generates 8 tokens
(`ignore_eos`). Three configurations, each on a fresh engine, run in turn for two rounds:
- `off`: EngineConfig's defaults (vLLM's: no partial prefills), the 256-token budget the server
  had: the long prompt's chunks take the whole budget, so a short one waits for its whole prefill;
- `threshold_128`: the same budget with long_prefill_token_threshold=128 and two partial prefills;
- `server`: what `python -m minillm serve` now runs (cli.SERVER_DEFAULTS: a 512-token budget,
  threshold 384, two partial prefills, one long; its prefill pacer off, so steps stay
  machine-independent).
Per short request: TTFT in engine steps (machine-independent, checked equal across rounds) and
seconds; per configuration the long request's time to first token and to the end (the cost of
sharing the budget), and the load average before and after each run (a shared machine slows every
number, by several times when other work oversubscribes its cores; the steps do not move).

Left out on purpose: the HTTP server (the engine's order is what is measured; the server adds
its fixed per-request cost), and GPUs.
"""
import os
import time

from benchmarks.records import write_result
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.datasets import chapter_prompts
from minillm.model.loading import default_device
from minillm.serve.cli import SERVER_DEFAULTS

CONFIGS = {
    "off": dict(max_num_batched_tokens=256),
    "threshold_128": dict(max_num_batched_tokens=256, long_prefill_token_threshold=128,
                          max_num_partial_prefills=2),
    # the server's token knobs; its pacer off: chunks in time would make the steps depend on the
    # machine's speed (benchmarks/short_beside_long.py measures the pacer)
    "server": {**SERVER_DEFAULTS, "prefill_step_target_ms": None},
}
ARRIVE_AT = (0.10, 0.35, 0.60, 0.85)     # fraction of the long prompt computed when each arrives
MAX_TOKENS = 8
UNITS = {"*_steps": "engine steps (machine-independent)", "*_s": "seconds of wall clock",
         "long_tokens / prompt_tokens": "tokens", "load_avg": "1-minute load average (os.getloadavg)"}


def long_prompt(tokenizer, n: int) -> list[int]:
    """n token ids of the chapters' prompts, repeated: a real text, not one token n times."""
    text = "\n\n".join(chapter_prompts())
    ids = tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def one_config(model, tokenizer, knobs: dict, long_ids: list[int], shorts: list[list[int]]) -> dict:
    engine = LLMEngine(model, EngineConfig(**knobs), tokenizer=tokenizer)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.generate([shorts[0]], params)                     # warm: first steps allocate
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    big = engine.add_request(long_ids, params)
    seq, pending, small = engine.requests[big].seqs[0], list(zip(ARRIVE_AT, shorts)), []
    while engine.has_unfinished_requests():
        while pending and seq.num_computed_tokens >= pending[0][0] * len(long_ids):
            small.append(engine.add_request(pending.pop(0)[1], params))
        engine.step()
    wall = time.perf_counter() - t0

    def row(rid):
        m = engine.requests[rid].metrics
        return {"prompt_tokens": len(engine.requests[rid].seqs[0].prompt_token_ids),
                "arrival_step": m.arrival_step - engine.requests[big].metrics.arrival_step,
                # steps from its arrival to its first token, that step included
                "ttft_steps": m.first_token_step - m.arrival_step + 1, "ttft_s": m.ttft, "e2e_s": m.e2e}
    return {"knobs": knobs, "long": row(big), "short": [row(r) for r in small],
            "num_steps": len(engine.trace), "wall_s": wall,
            "load_avg": {"before": load_before, "after": os.getloadavg()[0]}}


def run(quick: bool = False, device="cpu", out_dir=None, long_tokens: int | None = None,
        model=None, tokenizer=None, rounds: int | None = None) -> dict:
    """Run the three configurations in turn, `rounds` times (default 2, 1 with quick), and write
    benchmarks/results/lockout_<device>.json."""
    rounds = rounds or (1 if quick else 2)
    device = device or default_device()
    if model is None:
        from minillm import load_model
        model, tokenizer = load_model("smollm2-135m", device=device)
    n = long_tokens or (1024 if quick else 4096)
    long_ids = long_prompt(tokenizer, n)
    shorts = [tokenizer.encode(p) for p in chapter_prompts()[:len(ARRIVE_AT)]]
    runs = {name: {"knobs": knobs, "rounds": []} for name, knobs in CONFIGS.items()}
    for _ in range(rounds):              # in turn, so that a noisy neighbour slows them all alike
        for name, knobs in CONFIGS.items():
            runs[name]["rounds"].append(one_config(model, tokenizer, knobs, long_ids, shorts))
    for name, r in runs.items():         # the steps are the scheduler's: the same in every round
        steps = [[s["ttft_steps"] for s in x["short"]] for x in r["rounds"]]
        if any(st != steps[0] for st in steps):
            raise RuntimeError(f"{name}: step counts differ between rounds: {steps}")
        r.update(short_ttft_steps=steps[0], long_ttft_steps=r["rounds"][0]["long"]["ttft_steps"],
                 worst_short_ttft_s=[max(s["ttft_s"] for s in x["short"]) for x in r["rounds"]],
                 long_e2e_s=[x["long"]["e2e_s"] for x in r["rounds"]])
    payload = {"quick": quick, "long_tokens": n, "max_tokens": MAX_TOKENS, "rounds": rounds,
               "arrive_at_fraction_of_long_prefill": list(ARRIVE_AT), "configs": runs, "units": UNITS}
    record = {"benchmark": "lockout", **payload}
    record["path"] = str(write_result("lockout", payload, device=device, out_dir=out_dir))
    return record


def report(record: dict) -> str:
    lines = [f"short requests behind a {record['long_tokens']}-token prompt, {record['rounds']} "
             f"round(s) (TTFT in steps; worst short TTFT and the long request's end, per round):"]
    for name, r in record["configs"].items():
        loads = ", ".join(f"{x['load_avg']['before']:.1f}" for x in r["rounds"])
        lines.append(f"  {name:14s} shorts {r['short_ttft_steps']} steps, worst "
                     f"{[round(t, 1) for t in r['worst_short_ttft_s']]} s; long done "
                     f"{[round(t, 1) for t in r['long_e2e_s']]} s  (load {loads})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    import argparse
    p = argparse.ArgumentParser(prog="python -m benchmarks lockout")
    p.add_argument("--long-tokens", type=int, default=None, help="default 4096 (1024 with --quick)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    record = run(a.quick, "cpu", a.out, a.long_tokens, rounds=a.rounds)
    print(report(record), "\nrecord:", record["path"])
    return record


if __name__ == "__main__":
    main()
