"""Batch-1 speculative generation with the contiguous KV cache: the loop the engine generalizes.

Letters: K draft tokens per step, V vocab. One step:

1. the proposer drafts x_1..x_K (and its processed q) from the current context;
2. the target runs ONE forward pass over [last emitted token, x_1..x_K]: K + 1 positions, so
   p_1..p_{K+1} come out together (the verify step);
3. `rejection_sample` (or `greedy_verify` at temperature 0) keeps n drafts and one more token;
4. both caches roll back, for free: the next verify writes its tokens at the positions right
   after the accepted ones, over the rejected drafts' keys and values (a cache reads nothing
   past a query's position); the draft model feeds from the end of its common prefix.

The target cache always holds every token but the last emitted one, which is fed at the start
of the next verify step. Sampling parameters go through `logits_to_probs` for p exactly as the
proposer applies them to q.

With a tree proposer (one with `propose_tree`: Medusa, EAGLE, lookahead), each step verifies a
token tree instead of a chain: `tree_loop.py` runs that loop, this function only routes to it.

Left out on purpose: batches (see the engine), stop strings, logprobs.
"""
import time
from dataclasses import dataclass, field

import torch

from minillm.analysis.spec_theory import estimate_acceptance
from minillm.model.generate import _check
from minillm.model.kv_cache import KVCache
from minillm.model.sampling import logits_to_probs, next_token
from minillm.spec.proposer import Proposer
from minillm.spec.rejection import greedy_verify, rejection_sample
from minillm.spec.tree_loop import check_tree, tree_generate


@dataclass
class SpecStats:
    """Per-step counts and wall time, filled by `speculative_generate` (plain steps count K = 0).

    Two acceptance numbers, with different names because they answer different questions:

    - `accepted_fraction` = accepted / drafted, what was measured (the engine reports the same);
    - `alpha_estimate`, the per-token acceptance probability alpha of the i.i.d. theory
      (`spec_theory.estimate_acceptance`): a draft after the first rejection was never tested,
      so it counts only tested drafts and is always >= accepted_fraction.

    There is no `acceptance_rate` here: in minillm that name means accepted / drafted only (the
    engine's request metrics keep it as an alias of `accepted_fraction`).
    """
    num_proposed: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    # tree steps: per (depth, rank) of a draft node, steps where its parent was accepted / it was
    node_tested: dict = field(default_factory=dict)
    node_accepted: dict = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.num_proposed)

    @property
    def accepted_fraction(self) -> float:
        """Accepted / drafted tokens over all steps (nan when nothing was drafted)."""
        drafted = sum(self.num_proposed)
        return sum(self.num_accepted) / drafted if drafted else float("nan")

    @property
    def alpha_estimate(self) -> float:
        """Per-token acceptance probability alpha, maximum likelihood under the i.i.d. model."""
        return estimate_acceptance(self.num_accepted, self.num_proposed)

    @property
    def tokens_per_step(self) -> float:
        return (sum(self.num_accepted) + self.num_steps) / max(1, self.num_steps)

    def acceptance_by_position(self) -> dict:
        """{(depth, rank): P(node accepted | its parent was)} measured over the tree steps, the
        per-node acceptance `spec.tree_sizing` turns into a predicted tau and a tree."""
        return {key: self.node_accepted.get(key, 0) / n for key, n in sorted(self.node_tested.items())}


@torch.inference_mode()
def speculative_generate(target, proposer, prompt_ids, max_new_tokens: int,
                         num_speculative_tokens: int = 4, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None,
                         stop_token_ids: list[int] | None = None,
                         stats: SpecStats | None = None, adaptive_k=None, tree=None) -> list[int]:
    """Like `generate(target, ...)`, drafting `num_speculative_tokens` tokens per target pass.

    The output has exactly the law of `generate` (token for token at temperature 0). With
    `adaptive_k` (a policy with `.k` and `.update(num_accepted, num_proposed)`, e.g.
    `spec.adaptive.WindowedK`), each step asks for `adaptive_k.k` drafts instead of K; the output
    law is the same, only the number of target passes changes.

    A proposer with `propose_tree` (Medusa, EAGLE, lookahead) drafts a token tree each step:
    `tree` is a `TokenTree` or its list of paths (default: `TokenTree.chain(K)`), verified in one
    pass (`tree_loop.py`), with the same law and the same statistics (drafted = nodes - 1).
    """
    prompt = _check(target, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    K = num_speculative_tokens
    if not isinstance(K, int) or K < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {K!r}")
    if not isinstance(proposer, Proposer):
        raise TypeError(f"proposer must be a minillm.spec.proposer.Proposer, got "
                        f"{type(proposer).__name__}")
    draft_vocab = target.config.vocab_size if proposer.vocab_size is None else proposer.vocab_size
    if draft_vocab != target.config.vocab_size:
        raise ValueError(f"vocab mismatch: the draft model has {draft_vocab} tokens, the target "
                         f"{target.config.vocab_size}; speculative decoding needs one vocabulary")
    if adaptive_k is not None and not (hasattr(adaptive_k, "k")
                                       and callable(getattr(adaptive_k, "update", None))):
        raise TypeError(f"adaptive_k must have .k and .update(num_accepted, num_proposed), got "
                        f"{type(adaptive_k).__name__}")
    stats = stats if stats is not None else SpecStats()
    stop, dev = set(stop_token_ids or []), target.device
    if proposer.drafts_trees or tree is not None:
        if not proposer.drafts_trees:
            raise ValueError(f"tree= needs a tree proposer (one with propose_tree), got "
                             f"{type(proposer).__name__}")
        if adaptive_k is not None:
            raise ValueError("adaptive_k applies to chain drafts; pass tree= or adaptive_k, not both")
        return tree_generate(target, proposer, prompt, max_new_tokens, check_tree(tree, K),
                             (temperature, top_k, top_p), generator, stop, stats)
    # k is capped below at max_new_tokens - len(out) - 1, so a verify never writes past position
    # len(prompt) + max_new_tokens - 2: the same room `generate` needs, within the context
    cache = KVCache(target.config, 1, len(prompt) + max_new_tokens, dev, target.dtype)
    if len(prompt) > 1:
        target(torch.tensor([prompt[:-1]], device=dev), torch.arange(len(prompt) - 1, device=dev),
               cache, logits_index=torch.tensor([len(prompt) - 2]))           # prefill, (1, 1, V)
    out: list[int] = []
    while len(out) < max_new_tokens and not (out and out[-1] in stop):
        k = K if adaptive_k is None else max(1, int(adaptive_k.k))
        new = _step(target, proposer, cache, prompt + out, min(k, max_new_tokens - len(out) - 1),
                    (temperature, top_k, top_p), generator, stats)
        if adaptive_k is not None and stats.num_proposed[-1]:
            adaptive_k.update(stats.num_accepted[-1], stats.num_proposed[-1])
        for tok in new[:max_new_tokens - len(out)]:
            out.append(tok)
            if tok in stop:
                break
    return out


def _step(target, proposer, cache, context, k, params, generator, stats) -> list[int]:
    """One draft + verify step; returns the new tokens (1 to k + 1 of them)."""
    temperature, top_k, top_p = params
    dev, start = target.device, len(context) - 1             # cache holds context[:-1]
    t0 = time.perf_counter()
    prop = proposer.propose([context], k, temperature, top_k, top_p, generator) if k else None
    if prop is not None and prop.num_proposed is not None:
        k = min(k, int(prop.num_proposed[0]))               # n-gram: no match -> plain step
    t1 = time.perf_counter()
    drafts = prop.token_ids[:, :k].to(dev) if k else torch.zeros(1, 0, dtype=torch.long, device=dev)
    x = torch.cat([torch.tensor([[context[-1]]], device=dev), drafts], dim=1)     # (1, k + 1)
    positions = torch.arange(start, start + k + 1, device=dev)                     # (k + 1,)
    logits = target(x, positions, cache)                                           # (1, k + 1, V)
    if k == 0:                                               # a plain decode step
        tok = next_token(logits[:, -1], temperature, top_k, top_p, generator)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.num_proposed.append(0)
        stats.num_accepted.append(0)
        return [int(tok)]
    if temperature == 0:
        tokens, n = greedy_verify(logits, drafts)
    else:
        p = logits_to_probs(logits, temperature, top_k, top_p)                     # (1, k + 1, V)
        q = None if prop.probs is None else prop.probs[:, :k].to(dev)              # (1, k, V)
        tokens, n = rejection_sample(p, q, drafts, generator)
    n = int(n[0])      # rejected drafts stay in slots past start + n: the next step overwrites them
    stats.draft_s += t1 - t0
    stats.verify_s += time.perf_counter() - t1
    stats.num_proposed.append(k)
    stats.num_accepted.append(n)
    return tokens[0, :n + 1].tolist()


@torch.inference_mode()
def teacher_forced_acceptance(target, draft, token_ids: list[int], start: int,
                              temperature: float = 0.0, top_k=None, top_p=None) -> dict:
    """How well `draft` predicts `target` along a fixed sequence, from one forward pass each.

    For every position t >= start, with p and q the processed next-token laws after
    token_ids[:t]: `alpha` = mean of sum_x min(p(x), q(x)) = 1 - TV(p, q), the probability that
    rejection sampling accepts a sampled draft token (Leviathan et al.'s alpha), and `greedy` =
    mean of [argmax p == argmax q], the acceptance rate at temperature 0.
    """
    x = torch.tensor([token_ids], device=target.device)                           # (1, S)
    idx = torch.arange(start - 1, len(token_ids) - 1, device=target.device)
    lp, lq = target(x, logits_index=idx)[0], draft(x.to(draft.device), logits_index=idx)[0]
    greedy = (lp.argmax(-1) == lq.argmax(-1).to(lp.device)).double().mean()
    alpha = float("nan")
    if temperature > 0:
        p = logits_to_probs(lp, temperature, top_k, top_p)                        # (S', V)
        q = logits_to_probs(lq.to(lp.device), temperature, top_k, top_p)
        alpha = float(torch.minimum(p, q).sum(-1).double().mean())
    return {"greedy": float(greedy), "alpha": alpha, "positions": len(idx)}


@torch.inference_mode()
def replay_greedy(proposer, prompt_ids: list[int], reference: list[int], k: int) -> SpecStats:
    """The steps greedy speculative decoding would take to produce `reference` (the target's own
    greedy output), without running the target: each step accepts the longest prefix of the
    proposal that matches the reference. The same steps and accepted counts as
    `speculative_generate` at temperature 0 when its output is `reference`. The drafted counts
    match too when the answer runs to max_new_tokens; for an answer that stops early (EOS) the
    replay drafts nothing past the end it knows, while the live loop drafts past an end it cannot
    foresee, so it lists more drafted tokens in its last steps."""
    stats, done = SpecStats(), 0
    while done < len(reference):
        kk = min(k, len(reference) - done - 1)
        prop = proposer.propose([list(prompt_ids) + reference[:done]], kk) if kk else None
        if prop is not None and prop.num_proposed is not None:
            kk = min(kk, int(prop.num_proposed[0]))
        n = 0
        while n < kk and int(prop.token_ids[0, n]) == reference[done + n]:
            n += 1
        stats.num_proposed.append(kk)
        stats.num_accepted.append(n)
        done += n + 1
    return stats
