"""Time n-gram speculative decoding on any device from a recorded greedy schedule (chapter 6).

Greedy prompt-lookup decoding is a deterministic function of the prompt and the target's greedy
output, and a forward's time depends on its shape, not its weights. So the real model's outputs,
recorded once (`spec_schedule.json`), replay with random weights of the same architecture on any
machine: plain (`generate` for as many tokens) against the loop of `speculative_generate`, with
the accepted counts taken from the record. `replay(..., check=True)` on the real weights asserts
that the logits accept exactly what the schedule says.

    python -m benchmarks.spec_replay record   # real weights -> minillm/lab/spec_schedule.json
    python -m benchmarks spec_replay          # any weights, any device -> spec_replay_<device>.json

Left out on purpose: draft-model schedules (their cost needs the draft's own timings), sampling.
"""
import time
from pathlib import Path

import torch

from minillm.lab.common import sync
from minillm.model.generate import generate
from minillm.model.kv_cache import KVCache
from minillm.spec.proposers import NgramProposer
from minillm.spec.loop import replay_greedy
from minillm.analysis.spec_theory import free_verify_costs
from minillm.spec.rejection import greedy_verify


def schedule_file() -> Path:
    """The committed recording, shipped with the package: greedy outputs of the real model for
    the prompts of `prompts.SPEC_PROMPTS` (written by `python -m benchmarks.spec_replay record`)."""
    return Path(__file__).resolve().parent / "spec_schedule.json"


def _drafts(proposer, context: list[int], k: int) -> list[int]:
    """The proposer's drafts for `context`, at most k of them (none when k == 0)."""
    prop = proposer.propose([context], k) if k else None
    return prop.token_ids[0, :min(k, int(prop.num_proposed[0]))].tolist() if prop is not None else []


def _num_matching(cand: list[int], output: list[int], done: int) -> int:
    """How many drafts agree with the recorded output from position `done` on."""
    n = 0
    while n < len(cand) and cand[n] == output[done + n]:
        n += 1
    return n


def schedule(prompt: list[int], output: list[int], k: int, proposer=None) -> dict:
    """The greedy n-gram schedule alone, no model: per step the drafts proposed and accepted.

    Enough for the ceiling of prompt lookup on a recorded output: with every forward of up to
    k + 1 tokens as cheap as a 1-token one and drafting free, `len(output) / steps` is the decode
    speedup no hardware can beat for this K (chapter 6)."""
    if not prompt or not output or k < 1:
        raise ValueError("prompt and output must be non-empty token-id lists and k >= 1")
    stats = replay_greedy(proposer or NgramProposer(min_ngram=2), prompt, output, k)
    return {"tokens": len(output), "steps": len(stats.num_proposed),
            "num_proposed": stats.num_proposed, "num_accepted": stats.num_accepted}


def ceiling(data: dict, k: int, proposer=None, prefill_cost: dict | None = None) -> dict:
    """Speedup of each recorded prompt (and all together) if verify were free: plain runs a
    prefill then N - 1 one-token steps, speculative a prefill then its steps. `prefill_cost`
    (prompt name -> cost in 1-token steps, e.g. from spec_<device>.json) defaults to 0."""
    prefill_cost = prefill_cost or {}
    out, num, den = {}, 0.0, 0.0
    for name, p in data["prompts"].items():
        s = schedule(p["prompt"], p["output"], k, proposer)
        plain, spec = free_verify_costs(s["tokens"], s["steps"], prefill_cost.get(name, 0.0))
        out[name] = plain / spec
        num, den = num + plain, den + spec
    out["all"] = num / den
    return out


@torch.inference_mode()
def replay(model, prompt: list[int], output: list[int], k: int, proposer=None,
           check: bool = False) -> dict:
    """(plain seconds, speculative seconds, steps) of producing `output` after `prompt`."""
    if not prompt or not output:
        raise ValueError("prompt and output must be non-empty token-id lists")
    proposer = proposer or NgramProposer(min_ngram=2)
    dev, N = model.device, len(output)
    sync(dev)
    t0 = time.perf_counter()
    generate(model, prompt, N)                                       # no stop: exactly N tokens
    sync(dev)
    t_plain = time.perf_counter() - t0

    cache = KVCache(model.config, 1, min(len(prompt) + N + k + 1, model.config.max_seq_len), dev,
                    model.dtype)
    num_proposed, num_accepted = [], []
    sync(dev)
    t0 = time.perf_counter()
    if len(prompt) > 1:
        model(torch.tensor([prompt[:-1]], device=dev), torch.arange(len(prompt) - 1, device=dev),
              cache, logits_index=torch.tensor([len(prompt) - 2]))
    done = 0
    while done < N:
        context = prompt + output[:done]
        start = len(context) - 1                              # the cache holds context[:-1]
        cand = _drafts(proposer, context, min(k, N - done - 1))
        kk = len(cand)
        drafts = torch.tensor([cand], dtype=torch.long, device=dev)                   # (1, kk)
        x = torch.cat([torch.tensor([[context[-1]]], device=dev), drafts], dim=1)     # (1, kk + 1)
        logits = model(x, torch.arange(start, start + kk + 1, device=dev), cache)     # (1, kk + 1, V)
        if kk:                                                # what the logits say
            tokens, n_logits = greedy_verify(logits, drafts)
            n_logits, next_tok = int(n_logits[0]), int(tokens[0, n_logits[0]])
        else:                                                 # a plain decode step
            n_logits, next_tok = 0, int(logits[0, -1].argmax())
        n = _num_matching(cand, output, done)                 # what the real model accepted
        if check and (n_logits, next_tok) != (n, output[done + n]):
            raise AssertionError(f"step at token {done}: the logits give {n_logits} accepted "
                                 f"then {next_tok}, the recorded output {n} then {output[done + n]}")
        num_proposed.append(kk)
        num_accepted.append(n)
        done += n + 1
    sync(dev)
    t_spec = time.perf_counter() - t0
    return {"tokens": N, "plain_seconds": t_plain, "spec_seconds": t_spec,
            "speedup": t_plain / t_spec, "steps": len(num_proposed),
            "tokens_per_step": N / len(num_proposed), "num_proposed": num_proposed,
            "num_accepted": num_accepted}
