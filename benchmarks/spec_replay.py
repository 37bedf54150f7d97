"""The recorded n-gram schedule (chapter 6), recorded and replayed for the record.

`record` writes the real model's greedy outputs for chapter 6's prompts to the package data file
`minillm/lab/spec_schedule.json` (needs the real weights); `run` replays every recorded prompt with
`minillm.lab.spec_replay.replay` on any weights of the same shapes, on any device, and writes
spec_replay_<device>.json.

    python -m benchmarks.spec_replay record   # real weights -> minillm/lab/spec_schedule.json
    python -m benchmarks spec_replay          # any weights, any device -> spec_replay_<device>.json
"""
import json
from pathlib import Path

from benchmarks.gpu_model import bench_model
from benchmarks.records import write_result
from minillm.lab.prompts import SPEC_PROMPTS
from minillm.lab.spec_replay import replay, schedule_file
from minillm.model.chat import encode_chat
from minillm.model.generate import generate
from minillm.spec.proposers import NgramProposer

SETTINGS = {False: dict(k=8, min_ngram=2, max_ngram=3, repeat=3),
            True: dict(k=8, min_ngram=2, max_ngram=3, repeat=1)}


def record(model, tok, prompts: dict, max_new_tokens: int = 64, path=None) -> dict:
    """Greedy outputs of the real model for each prompt (stopping at the chat end-of-turn)."""
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    data = {"model": model.config.name, "max_new_tokens": max_new_tokens, "prompts": {}}
    for name, text in prompts.items():
        ids = encode_chat(tok, text)
        data["prompts"][name] = {"prompt": ids, "output": generate(model, ids, max_new_tokens,
                                                                   stop_token_ids=stop)}
    Path(path if path is not None else schedule_file()).write_text(json.dumps(data) + "\n")
    return data


def run(quick: bool = False, device=None, out_dir=None, model=None, schedule_path=None) -> dict:
    """Replay every recorded prompt (best of `repeat`); writes spec_replay_<device>.json."""
    s = SETTINGS[bool(quick)]
    data = json.loads(Path(schedule_path or schedule_file()).read_text())
    weights = "given"
    if model is None:
        model, _, weights = bench_model(device)        # fp32 on a CPU, bf16 on a GPU
    proposer = NgramProposer(min_ngram=s["min_ngram"], max_ngram=s["max_ngram"])
    res = {"settings": s, "schedule_model": data["model"], "weights": weights,
           "dtype": str(model.dtype), "prompts": {},
           "units": {"plain_seconds": "s (best of repeat)", "spec_seconds": "s (best of repeat)",
                     "speedup": "plain / speculative time", "tokens_per_step": "tokens per target pass"}}
    first = next(iter(data["prompts"].values()))
    replay(model, first["prompt"], first["output"][:4], s["k"], proposer)      # warm-up
    for name, p in data["prompts"].items():
        best = None
        for _ in range(s["repeat"]):
            r = replay(model, p["prompt"], p["output"], s["k"], proposer)
            if best is None:
                best = r
            best["plain_seconds"] = min(best["plain_seconds"], r["plain_seconds"])
            best["spec_seconds"] = min(best["spec_seconds"], r["spec_seconds"])
        best["speedup"] = best["plain_seconds"] / best["spec_seconds"]
        res["prompts"][name] = best
    ps = res["prompts"].values()
    res["speedup"] = sum(r["plain_seconds"] for r in ps) / sum(r["spec_seconds"] for r in ps)
    res["path"] = str(write_result("spec_replay", res, device=model.device, out_dir=out_dir))
    return res


def report(r: dict) -> str:
    lines = [f"n-gram schedule of {r['schedule_model']} replayed with {r['weights']} weights, "
             f"K = {r['settings']['k']}:"]
    for name, e in r["prompts"].items():
        lines.append(f"  {name:>10}: {e['tokens']} tokens in {e['steps']} steps "
                     f"({e['tokens_per_step']:.2f}/step): {e['speedup']:.2f}x")
    lines.append(f"  all prompts: {r['speedup']:.2f}x   wrote {r['path']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_replay")
    p.add_argument("command", nargs="?", default="replay", choices=["record", "replay"])
    p.add_argument("--device", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.command == "record":
        from minillm.llm import load_model
        model, tok = load_model(device="cpu")
        record(model, tok, SPEC_PROMPTS)
        print(f"wrote {schedule_file()}")
    else:
        print(report(run(a.quick, a.device)))


if __name__ == "__main__":
    main()
