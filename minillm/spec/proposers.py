"""Drafters for speculative decoding, behind one interface: `propose(contexts, k, ...) -> Proposal`.

Letters: B batch, S context length, K draft tokens, V vocab.

- `NgramProposer`: prompt lookup. Find the most recent earlier occurrence of the context's last n
  tokens (n from max_ngram down to min_ngram) and propose the K tokens that followed it. No model,
  deterministic (q is one-hot), free to run; it shines when the output copies the input.
- `DraftModelProposer`: any minillm-style model with the target's vocabulary samples K tokens
  with the same temperature / top-k / top-p as the target and reports its processed q. At batch 1
  it keeps a contiguous `KVCache` per sequence (up to `max_cached_seqs`) and feeds each context
  from the end of the longest prefix it shares with the cache (rejected drafts are overwritten).
  Larger batches of equal-length contexts recompute without a cache (the reference path).
- Self-drafts of the target, for teaching: `bf16_copy` (the same weights in bfloat16),
  `early_exit_model` (the first L layers, then the final norm and lm_head) and `layer_skip_model`
  (a chosen subset of layers). The last two share weights with the target; no copy is made.

Left out on purpose: trained draft heads (Medusa, EAGLE), tree drafts, per-row K, ragged batched
draft caches (the engine's job).
"""
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from minillm.model.kv_cache import KVCache
from minillm.model.llama import Transformer
from minillm.model.sampling import check_sampling_args, logits_to_probs
from minillm.spec.proposer import Proposer


@dataclass
class Proposal:
    """K draft tokens per row. probs None = deterministic drafter (q one-hot at token_ids)."""
    token_ids: torch.Tensor                   # (B, K) long
    probs: torch.Tensor | None = None         # (B, K, V) processed q
    num_proposed: torch.Tensor | None = None  # (B,) real drafts; the rest is padding (n-gram)


def _contexts(contexts) -> list[list[int]]:
    if isinstance(contexts, torch.Tensor):
        contexts = contexts.tolist() if contexts.dim() == 2 else [contexts.tolist()]
    if not contexts or not all(isinstance(c, (list, tuple)) and len(c) > 0 for c in contexts):
        raise ValueError("contexts must be a non-empty list of non-empty token-id lists (B rows)")
    return [list(c) for c in contexts]


def _check_k(k) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (num_speculative_tokens) must be an int >= 1, got {k!r}")


class NgramProposer(Proposer):
    """Prompt-lookup drafting: copy what followed the last earlier match of the context's tail."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier occurrence of the longest tail."""
        ctx = torch.tensor(context)
        S = len(context)
        for n in range(min(self.max_ngram, S - 1), self.min_ngram - 1, -1):
            windows = ctx[:S - 1].unfold(0, n, 1)                   # (S - n, n); excludes the tail
            hits = (windows == ctx[S - n:]).all(dim=1).nonzero().flatten()
            if len(hits):
                start = int(hits[-1]) + n                           # token after the match
                return context[start:start + k]
        return []

    def propose(self, contexts, k: int, temperature: float = 0.0, top_k=None, top_p=None,
                generator=None) -> Proposal:
        """(B,) contexts -> Proposal with token_ids (B, k), probs None; short rows are padded
        with their last token (any padding is exact: a one-hot draft is accepted w.p. p(x))."""
        contexts, _ = _contexts(contexts), _check_k(k)
        rows, counts = [], []
        for ctx in contexts:
            found = self.lookup(ctx, k)
            counts.append(len(found))
            rows.append(found + [found[-1] if found else ctx[-1]] * (k - len(found)))
        return Proposal(torch.tensor(rows), None, torch.tensor(counts))


class DraftModelProposer(Proposer):
    """Sample K tokens from a draft model with the target's sampling parameters."""

    keyed = True                            # one draft cache per sequence (the engine's seq_id)

    def __init__(self, model, use_cache: bool = True, max_cached_seqs: int = 8):
        self.model, self.use_cache, self.max_cached_seqs = model, use_cache, max_cached_seqs
        self.reset()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def reset(self) -> None:
        self._slots: list[list] = []        # [KVCache, tokens it holds, key], most recent last

    @property
    def _cache(self):
        return self._slots[-1][0] if self._slots else None

    @staticmethod
    def _common(a: list[int], b: list[int]) -> int:
        m = 0
        for x, y in zip(a, b):
            if x != y:
                break
            m += 1
        return m

    def _slot_for(self, context: list[int], key=None) -> list:
        """The cache for this context. With a `key` (the engine passes each sequence's id) the
        slot of that key; without one, the slot sharing the longest prefix with the context. A
        new slot while fewer than max_cached_seqs exist, else the least recently used is recycled."""
        if key is not None:
            best = next((sl for sl in self._slots if sl[2] == key), None)
        else:
            best = max(self._slots, key=lambda sl: self._common(sl[1], context), default=None)
            if best is not None and self._common(best[1], context) == 0:
                best = None
        if best is None:
            fresh = len(self._slots) < self.max_cached_seqs
            best = [None, [], key] if fresh else self._slots[0]   # else recycle the least recent
            best[2] = key
        if best in self._slots:
            self._slots.remove(best)
        self._slots.append(best)
        need = len(context) + 64
        if best[0] is None or need > best[0].max_seq_len:
            size = min(max(2 * need, 256), self.model.config.max_seq_len)
            best[0] = KVCache(self.model.config, 1, size, self.model.device, self.model.dtype)
            best[1] = []
        return best

    def _logits_batch1(self, context: list[int], key=None) -> torch.Tensor:
        """Next-token logits (1, V) after `context`, reusing the cached common prefix."""
        slot = self._slot_for(context, key)
        cache = slot[0]
        m = min(self._common(slot[1], context), len(context) - 1)   # feed >= 1 token
        # feed the tokens from m on at their positions: they overwrite any rejected drafts there
        x = torch.tensor([context[m:]], device=self.model.device)                # (1, T)
        positions = torch.arange(m, len(context), device=self.model.device)     # (T,)
        logits = self.model(x, positions, cache, logits_index=torch.tensor([x.shape[1] - 1]))
        slot[1] = list(context)
        return logits[:, -1]                                                      # (1, V)

    def _step_logits(self, ids: torch.Tensor, batch1: bool, key=None) -> torch.Tensor:
        if batch1:
            return self._logits_batch1(ids[0].tolist(), key)
        return self.model(ids)[:, -1]                                             # (B, V)

    @torch.inference_mode()
    def propose(self, contexts, k: int, temperature: float = 0.0, top_k=None, top_p=None,
                generator=None, key=None) -> Proposal:
        """(B,) contexts -> K sampled drafts and their q. `key` names the sequence of a batch-1
        call, so that each sequence keeps its own draft cache (the engine passes its seq_id)."""
        contexts, _ = _contexts(contexts), _check_k(k)
        check_sampling_args(temperature, top_k, top_p)
        if len({len(c) for c in contexts}) != 1:
            raise ValueError("DraftModelProposer needs equal-length contexts when B > 1")
        batch1 = self.use_cache and len(contexts) == 1
        ids = torch.tensor(contexts, device=self.model.device)                    # (B, S)
        toks, qs = [], []
        for _ in range(k):
            logits = self._step_logits(ids, batch1, key)                          # (B, V)
            if temperature == 0:
                tok = logits.argmax(-1)                                           # (B,)
            else:
                q = logits_to_probs(logits, temperature, top_k, top_p)            # (B, V)
                tok = draw(q, generator)
                qs.append(q)
            toks.append(tok)
            ids = torch.cat([ids, tok[:, None]], dim=1)                           # (B, S + 1)
        token_ids = torch.stack(toks, dim=1)                                      # (B, K)
        probs = torch.stack(qs, dim=1) if qs else None                            # (B, K, V)
        return Proposal(token_ids, probs, torch.full((len(contexts),), k))


def draw(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """(B, V) -> (B,) with one generator for the batch or a list of one generator per row."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(p[None], 1, generator=g)[:, 0]
                          for p, g in zip(probs, generator, strict=True)])
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class LayerSubsetModel(Transformer):
    """The target with only some of its layers: the same embed, blocks, final norm and lm_head
    (shared, not copied), run by the Transformer's own forward. Its cache has one layer per kept
    block, indexed by the block's place in this model (the model passes that index)."""

    def __init__(self, model, layers: list[int]):
        nn.Module.__init__(self)                                # share the target's modules
        n = model.config.n_layer
        if not layers or sorted(set(layers)) != list(layers) or not 0 <= layers[0] <= layers[-1] < n:
            raise ValueError(f"layers must be a non-empty increasing list of indices in [0, {n})")
        self.target, self.layer_ids = [model], list(layers)     # list: do not register as child
        self.config = model.config.with_(n_layer=len(layers))
        self.embed, self.norm, self.lm_head = model.embed, model.norm, model.lm_head
        self.layers = nn.ModuleList(model.layers[i] for i in layers)


def early_exit_model(model, num_layers: int) -> LayerSubsetModel:
    """The first `num_layers` layers of the target, then its final norm and lm_head."""
    return LayerSubsetModel(model, list(range(num_layers)))


def layer_skip_model(model, skip: list[int]) -> LayerSubsetModel:
    """The target without the layers in `skip`."""
    return LayerSubsetModel(model, [i for i in range(model.config.n_layer) if i not in set(skip)])


def bf16_copy(model):
    """A bfloat16 copy of the target (the same network at half the bytes per weight)."""
    return copy.deepcopy(model).to(torch.bfloat16)
