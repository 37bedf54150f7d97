"""Drafting without a copy (chapter 10): tau and speedup over plain decoding for Medusa, EAGLE,
lookahead, n-gram, chapter 6's best self-draft (bf16) and the int4 copy of the target (chapter 7),
on held-out open chat prompts.

1. Batch 1 (`speculative_generate`, the batch-1 loop with one tree pass per step), greedy and at
   temperature 0.7 (seeded): tokens per step (tau), speedup over plain `generate` in the same
   run (interleaved rounds, best kept), greedy outputs checked equal to plain decoding.
2. The tree sized for this machine (`spec.tree_sizing.size_tree`) from the per-node acceptance
   of a wide Medusa tree and this machine's verify costs, and for an H200 from its roofline;
   predicted tau against the tau the sized tree measures.
3. Batch 4 through `LLMEngine` with `speculative_config` (the engine verifies the top-ranked
   chain): tokens/s against the plain engine on the same four prompts, greedy.
4. The EAGLE drafting term: one chain proposal of K = 1, 2, 3 per drafted token, against one
   plain decode step in the same rounds, with the drafter's key/value cache and without it
   (`lab.drafting_runs.drafting_costs`).

5. The speedup's terms per method (`lab.drafting_runs.speedup_terms`): tau, drafting and verify
   in plain steps, the speedup they predict beside the measured one, and the H200's bound (its
   roofline verify cost, drafting left out).

The drafters are the "data" recipe's where `python -m minillm.drafting train --recipe data`
cached them, else the full recipe's (`train_medusa`, `train_eagle`: trained on first use,
minutes). Measure on a quiet machine; `--threads=N` pins torch's thread count.

    python -m benchmarks drafting [--quick]
"""
import copy
import json
import time

import torch

from benchmarks.records import write_result
from minillm.analysis.roofline import get_hardware
from minillm.drafting.prompts import EVAL_CHAT_PROMPTS
from minillm.drafting.train import cached_drafter, train_eagle, train_medusa
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.drafting_runs import drafting_costs, speedup_terms, time_methods, verify_costs
from minillm.model.chat import encode_chat
from minillm.model.loading import default_device, load_model
from minillm.quant.api import quantize
from minillm.spec.lookahead import LookaheadProposer
from minillm.spec.proposers import DraftModelProposer, NgramProposer, bf16_copy
from minillm.spec.trained_proposers import EagleProposer, MedusaProposer
from minillm.spec.tree import TokenTree
from minillm.spec.tree_sizing import cost_fn, expected_tau, roofline_costs, size_tree

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
WIDE = [(r,) for r in range(4)] + [(0, r) for r in range(4)] + [(0, 0, r) for r in range(4)]
UNITS = {"seconds": "s, sum over the prompts (best round)", "tau": "tokens per target pass",
         "speedup": "plain time / method time, same run", "tokens_per_s": "output tokens per second",
         "verify_costs_ms": "ms, one forward of n tokens after 128 cached",
         "acceptance": "P(node at (depth, rank) accepted | its parent was)"}
SAMPLED_TEMPERATURE = 0.7
SETTINGS = {False: dict(prompts=4, max_new_tokens=64, rounds=1, batch=4),
            True: dict(prompts=2, max_new_tokens=32, rounds=1, batch=2)}


def _methods(model, heads, drafter, tree):
    return {"ngram": (NgramProposer(min_ngram=2), None, 4),
            "bf16 self-draft": (DraftModelProposer(bf16_copy(model)), None, 4),
            "int4 self-draft": (DraftModelProposer(quantize(copy.deepcopy(model), "int4")), None, 4),
            "medusa": (MedusaProposer(model, heads), tree, 3),
            "eagle": (EagleProposer(model, drafter, dynamic=True), tree, 3),
            "eagle K=1": (EagleProposer(model, drafter), TokenTree.chain(1), 1),
            "lookahead": (LookaheadProposer(window=4, ngram=3, max_candidates=4), None, 4)}


def drafters(model, tok):
    """The best drafters this machine has: the "data" recipe's where `python -m minillm.drafting
    train --recipe data` cached them, else the full recipe's (trained now if missing)."""
    heads, drafter = cached_drafter(model, "medusa", "data"), cached_drafter(model, "eagle", "data")
    if heads is not None and drafter is not None:
        return heads, drafter, "data"
    return train_medusa(model, tok), train_eagle(model, tok), "full"


def _engine(model, prompts, spec: dict | None, B: int, n: int, stop) -> dict:
    cfg = EngineConfig(max_num_seqs=B, max_num_batched_tokens=512)
    engine = LLMEngine(model, cfg, speculative_config=spec)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, stop_token_ids=stop))
    wall = time.perf_counter() - t0
    m = [o.metrics for o in outs]
    steps = sum(x.num_spec_steps for x in m)
    return {"seconds": wall, "tokens": sum(len(o.token_ids) for o in outs),
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
            "tau": (sum(x.num_accepted_tokens for x in m) + steps) / steps if steps else 1.0,
            "outputs": [o.token_ids for o in outs]}


def batch_engine(model, heads, drafter, prompts, B: int, n: int, stop, rounds: int) -> dict:
    specs = {"plain": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
             "medusa": {"method": "medusa", "num_speculative_tokens": 3, "model": heads},
             "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": drafter},
             "lookahead": {"method": "lookahead", "num_speculative_tokens": 4}}
    best = {}
    for _ in range(rounds):
        for name, spec in specs.items():
            r = _engine(model, prompts[:B], spec, B, n, stop)
            if r["seconds"] < best.get(name, {}).get("seconds", float("inf")):
                best[name] = r
    ref = best["plain"]["outputs"]
    for name, r in best.items():
        r["same_as_plain"] = r.pop("outputs") == ref
        r["speedup"] = r["tokens_per_s"] / best["plain"]["tokens_per_s"]
    return {"batch": B, "methods": best}


def run(quick: bool = False, device=None, out_dir=None, num_threads: int | None = None) -> dict:
    s = SETTINGS[quick]
    if num_threads:
        torch.set_num_threads(num_threads)
    device = torch.device(device) if device is not None else default_device()
    model, tok = load_model(device=device)
    heads, drafter, recipe = drafters(model, tok)
    stop = [tok.eos_token_id]
    prompts = [encode_chat(tok, p) for p in EVAL_CHAT_PROMPTS[:s["prompts"]]]
    tree = TokenTree(TREE)
    result = {"units": UNITS, "settings": {**s, "tree": TREE, "wide_tree": WIDE, "recipe": recipe,
                           "sampled_temperature": SAMPLED_TEMPERATURE}, "batch1": {},
              "eagle_curve": drafter.meta.get("curve", [])}    # held-out top-1 as it trained
    here = verify_costs(model)
    gpu, _ = cost_fn(roofline_costs(model.config, get_hardware("h200"), max_tokens=64))
    for label, temp in (("greedy", 0.0), ("sampled", SAMPLED_TEMPERATURE)):
        runs = time_methods(model, prompts, _methods(model, heads, drafter, tree), s["max_new_tokens"],
                            temperature=temp, rounds=s["rounds"], stop=stop)
        result["batch1"][label] = {k: {**v, "acceptance": {str(a): p for a, p in v["acceptance"].items()}}
                                       for k, v in runs.items()}
        if temp == 0.0:
            terms = speedup_terms(runs, here)
            for t in terms.values():       # the H200's roofline verify, drafting left out: a bound
                t["h200_bound"] = t["tau"] * gpu(1) / gpu(min(64, round(t["rows"])))
            result["terms"] = terms
    wide = time_methods(model, prompts, {"wide": (MedusaProposer(model, heads), TokenTree(WIDE), 3)},
                        s["max_new_tokens"], rounds=1, stop=stop)["wide"]
    accept = wide["acceptance"]
    costs = {"this machine": here,
             "H200 roofline bf16": roofline_costs(model.config, get_hardware("h200"), max_tokens=64)}
    sizing = {}
    for machine, c in costs.items():
        choice = size_tree(accept, c, max_depth=3, max_rank=4, max_nodes=13)
        sizing[machine] = {"paths": [list(p) for p in choice.tree.paths], "tau": choice.tau,
                           "predicted_speedup": choice.speedup,
                           "verify_ratio_9": c[9] / c[1] if 9 in c else None}
    big = size_tree(accept, costs["H200 roofline bf16"], max_depth=3, max_rank=4, max_nodes=13).tree
    check = time_methods(model, prompts, {"sized": (MedusaProposer(model, heads), big, 3)},
                         s["max_new_tokens"], rounds=1, stop=stop)["sized"]
    result["tree_sizing"] = {"acceptance": {str(k): v for k, v in accept.items()},
                             "verify_costs_ms": {str(k): v for k, v in costs["this machine"].items()},
                             "trees": sizing, "tau_predicted": expected_tau(big, accept),
                             "tau_measured": check["tau"], "same_as_plain": check["same_as_plain"]}
    result["drafting_cost"] = drafting_costs(model, drafter, rounds=5 if quick else 15)
    result["batch_engine"] = batch_engine(model, heads, drafter, prompts * 2, s["batch"],
                                          s["max_new_tokens"], stop, s["rounds"])
    path = write_result("drafting", result, device, out_dir)
    return {**json.loads(path.read_text()), "path": str(path)}


def report(r: dict) -> str:
    lines = [f"{r['machine'].get('device_name', '?')}, "
             f"{r['machine'].get('torch_threads', '?')} threads, load {(r['machine'].get('load_average') or ['?'])[0]}"]
    for label, runs in r["batch1"].items():
        lines.append(f"batch 1, {label}:   tau   speedup  same as plain")
        for name, v in runs.items():
            lines.append(f"  {name:16} {v['tau']:.2f}  {v['speedup']:.2f}x    {v['same_as_plain']}")
    lines.append(f"the speedup's terms (greedy, {r['settings'].get('recipe', 'full')} drafters), in plain "
                 f"steps: tau / (draft + verify) = predicted, beside measured")
    for name, t in r.get("terms", {}).items():
        lines.append(f"  {name:16} tau {t['tau']:.2f}  draft {t['draft']:.3f}  verify {t['verify']:.2f}  "
                     f"predicted {t['predicted']:.2f}x  measured {t['measured']:.2f}x  "
                     f"H200 bound {t['h200_bound']:.2f}x")
    t = r["tree_sizing"]
    for machine, c in t["trees"].items():
        lines.append(f"tree for {machine}: {len(c['paths'])} draft nodes, tau {c['tau']:.2f}, "
                     f"predicted {c['predicted_speedup']:.2f}x")
    lines.append(f"sized tree: tau predicted {t['tau_predicted']:.2f}, measured {t['tau_measured']:.2f}")
    c = r["drafting_cost"]
    for name in ("no cache", "cached"):
        per = ", ".join(f"K={k} {v:.3f}x" for k, v in c[f"{name} per_token"].items())
        lines.append(f"EAGLE drafting per drafted token / plain step ({c['plain_ms']:.1f} ms), "
                     f"{name}: {per}")
    b = r["batch_engine"]
    lines.append(f"batch {b['batch']} in the engine (chain of the top guesses):")
    for name, v in b["methods"].items():
        lines.append(f"  {name:16} {v['tokens_per_s']:.1f} tok/s  {v['speedup']:.2f}x  tau {v['tau']:.2f}  "
                     f"same {v['same_as_plain']}")
    return "\n".join(lines)
