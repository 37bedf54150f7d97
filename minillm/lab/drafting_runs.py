"""Runs of chapter 10's drafters on held-out chat prompts: tokens per step (tau) and speedup over
plain decoding, measured in one process (chapter 10 and `python -m benchmarks drafting`).

Letters: K speculative tokens (the depth of a chain or tree), N nodes of a tree (root included).

`time_methods` decodes every prompt with plain `generate` and with each method's proposer through
`speculative_generate`, in interleaved rounds (the best round of each kept), checks greedy outputs
against plain decoding, and returns per method: tau (tokens per target pass), the measured speedup,
the per-(depth, rank) acceptance the run saw, and the step's verify size. `verify_costs` times one
forward of n tokens after a cached context (chapter 1's `forward_cost`, the tuned route), the cost
curve `spec.tree_sizing.size_tree` turns into a tree for this machine. `drafting_costs` times one
EAGLE chain proposal of K tokens, with the drafter's key/value cache and without it, against one
plain decode step in the same rounds: the drafting term of the speedup. `speedup_terms` splits
a run into the formula's terms (tau, draft, verify, in plain steps) and the speedup they predict.

Left out on purpose: the engine (batch > 1 lives in the benchmark), prefill-only timings.
"""
import statistics
import time

import torch

from minillm.lab.common import prefilled
from minillm.lab.forward_cost import forward_cost
from minillm.model.generate import generate
from minillm.spec.loop import SpecStats, speculative_generate
from minillm.spec.trained_proposers import EagleProposer, context_features
from minillm.spec.tree_sizing import cost_fn

VERIFY_SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def verify_costs(model, sizes=VERIFY_SIZES, context: int = 128, rounds: int = 3) -> dict:
    """{n: median ms of one forward of n new tokens after `context` cached}, this machine."""
    cost = forward_cost(model, rows=tuple(sizes), context=context, rounds=rounds, routes=("auto",))
    return {n: cost["auto"][str(n)] for n in sizes}


def _run(model, prompt, proposer, tree, k, n, temperature, seed, stop):
    gen = torch.Generator(device=model.device).manual_seed(seed) if temperature > 0 else None
    stats = SpecStats()
    t0 = time.perf_counter()
    if proposer is None:
        out = generate(model, prompt, n, temperature, generator=gen, stop_token_ids=stop)
    else:
        proposer.reset()
        out = speculative_generate(model, proposer, prompt, n, num_speculative_tokens=k,
                                   temperature=temperature, generator=gen, stop_token_ids=stop,
                                   stats=stats, tree=tree)
    return out, time.perf_counter() - t0, stats


@torch.inference_mode()
def time_methods(model, prompts: list[list[int]], methods: dict, max_new_tokens: int = 64,
                 temperature: float = 0.0, rounds: int = 2, seed: int = 0, stop=None) -> dict:
    """methods: {name: (proposer, tree or None, K)}. Returns {"plain": {...}, name: {...}} with
    seconds (sum over prompts of each prompt's best round), tokens, tau, speedup, same_as_plain
    (greedy only; None when sampling), acceptance {(depth, rank): p}, and nodes (the verify size of a step)."""
    cases = {"plain": (None, None, 1), **methods}
    best = {name: [float("inf")] * len(prompts) for name in cases}
    outs, stats = {}, {}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            for name, (proposer, tree, k) in cases.items():
                out, sec, st = _run(model, prompt, proposer, tree, k, max_new_tokens,
                                    temperature, seed + i, stop)
                if sec < best[name][i]:                 # the best round's counts and times
                    best[name][i] = sec
                    outs[(name, i)], stats[(name, i)] = out, st
    plain_s = sum(best["plain"])
    result = {}
    for name in cases:
        merged = SpecStats()
        for i in range(len(prompts)):
            st = stats[(name, i)]
            merged.num_proposed += st.num_proposed
            merged.num_accepted += st.num_accepted
            merged.draft_s += st.draft_s
            merged.verify_s += st.verify_s
            for key, v in st.node_tested.items():
                merged.node_tested[key] = merged.node_tested.get(key, 0) + v
            for key, v in st.node_accepted.items():
                merged.node_accepted[key] = merged.node_accepted.get(key, 0) + v
        tokens = sum(len(outs[(name, i)]) for i in range(len(prompts)))
        seconds = sum(best[name])
        result[name] = {
            "seconds": seconds, "tokens": tokens,
            "tau": merged.tokens_per_step if name != "plain" else 1.0,
            "steps": merged.num_steps, "speedup": plain_s / seconds,
            "same_as_plain": (all(outs[(name, i)] == outs[("plain", i)] for i in range(len(prompts)))
                              if temperature == 0 else None),      # sampled runs: the same law only
            "acceptance": merged.acceptance_by_position() if name != "plain" else {},
            "draft_s": merged.draft_s, "verify_s": merged.verify_s,
            "verify_rows": [n + 1 for n in merged.num_proposed]}
    return result


def speedup_terms(runs: dict, costs: dict) -> dict:
    """The speedup formula's terms for each method of a `time_methods` result, in plain decode
    steps (the plain run's seconds per token in the same run), and the speedup they predict:

      speedup = tau / (draft + verify),  draft = drafting seconds per step / plain step,
      verify = mean over the steps of cost(rows) / cost(1), from `costs` ({n: time},
      `verify_costs`: a forward of n tokens, timed apart from the run).

    Also "verify_measured": the run's own verify seconds per step (with the acceptance and
    cache bookkeeping around the forward) / plain step, and "measured" the run's speedup."""
    cost, n_max = cost_fn(costs)
    plain = runs["plain"]
    step = plain["seconds"] / max(1, plain["tokens"])
    out = {}
    for name, r in runs.items():
        if name == "plain" or not r.get("steps"):
            continue
        rows = r["verify_rows"]
        verify = sum(cost(min(n, n_max)) for n in rows) / len(rows) / cost(1)
        draft = r["draft_s"] / r["steps"] / step
        out[name] = {"tau": r["tau"], "draft": draft, "verify": verify,
                     "verify_measured": r["verify_s"] / r["steps"] / step,
                     "rows": sum(rows) / len(rows), "predicted": r["tau"] / (draft + verify),
                     "measured": r["speedup"]}
    return out


@torch.inference_mode()
def drafting_costs(model, drafter, ks=(1, 2, 3), context: int = 150, rounds: int = 15,
                   window: int = 32) -> dict:
    """Median ms of one plain decode step after `context` cached tokens and of one EAGLE chain
    proposal of k tokens at about that context (features given, as the verify pass hands them
    over), by the cached proposer ("cached": each round's context is its last plus `grow`
    accepted tokens, so its stable window computes `grow` rows) and the reference that reruns
    its window ("no cache"), all interleaved in each round. "per_token": ms / k / plain ms."""
    grow = 2
    ctx = torch.randint(0, model.config.vocab_size, (context + grow * (rounds + 1),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    feats = context_features(model, ctx)                               # (len - 1, C)
    _, step = prefilled(model, 1, context, 1)
    x = torch.ones(1, 1, dtype=torch.long, device=model.device)
    names = {"no cache": False, "cached": True}
    cases = {("plain", 0): lambda r: step(x)}
    for name, cached in names.items():
        for k in ks:                         # a proposer each: its own stable window
            prop = EagleProposer(model, drafter, window=window, kv_cache=cached)
            cases[(name, k)] = lambda r, p=prop, k=k: p.propose(
                [ctx[:context + grow * r]], k, features=[feats[:context + grow * r - 1]])
    for fn in cases.values():
        fn(0)                                # warm: the stable windows start filled
    times = {key: [] for key in cases}
    for r in range(1, rounds + 1):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            fn(r)
            times[key].append((time.perf_counter() - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}
    plain = med[("plain", 0)]
    out = {"plain_ms": plain, "context": context, "window": window, "rounds": rounds,
           "accepted_per_round": grow}
    for name in names:
        out[name] = {k: med[(name, k)] for k in ks}
        out[f"{name} per_token"] = {k: med[(name, k)] / k / plain for k in ks}
    return out
