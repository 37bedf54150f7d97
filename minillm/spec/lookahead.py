"""Lookahead (Jacobi) decoding: the target's own guesses fill an n-gram pool; no draft model.

Letters: W window (Jacobi guesses), N n-gram size, G verification candidates, K chain drafts,
V vocab.

One token tree, rooted at the last token, carries the W current guesses (the lookahead branch)
and up to G pool n-grams that followed the root, merged into a trie. The verifier keeps whatever
path the target agrees with; `observe` does one Jacobi step from the same logits, and each guess's
lineage (the tokens it grew from across iterations) enters the pool once it is N tokens long. The
next call shifts the guesses past the accepted tokens. Exact at any temperature: the proposer only
chooses what to verify. The chain form `propose(contexts, k)` drafts the newest matching n-gram;
without verify logits its pool learns from the accepted output (`learn_from_output`).

Left out on purpose: the paper's 2-D window (the lineages carry the past levels instead) and
sampled guesses.
"""
import torch

from minillm.spec.proposer import Proposer
from minillm.spec.proposers import Proposal, _check_k, _contexts
from minillm.spec.tree import TreeDraft


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


class _Seq:
    """One sequence's lookahead state: the context it last saw, its guesses and n-gram pool."""

    def __init__(self, context: list[int], key):
        self.context, self.key = list(context), key
        self.base = len(context)            # guesses[0] is the guess for position `base`
        self.known = len(context)           # context tokens already read into the pool
        self.guesses: list[int] = []
        self.lineage: list[tuple[int, ...]] = []   # per guess: the diagonal it ends (<= N tokens)
        self.pool: dict[int, list[tuple[int, ...]]] = {}   # token -> (N-1)-grams, newest last


class LookaheadProposer(Proposer):
    """Lookahead decoding's drafts: W Jacobi guesses plus up to G n-grams from the pool.

    >>> p = LookaheadProposer(window=3, ngram=2, max_candidates=2, seed=0)
    >>> d = p.propose_tree([5, 6, 7, 5, 6])
    >>> d.tokens[0].item(), d.parents[:2], len(d.tokens)     # the root, then the W guesses
    (6, [-1, 0], 4)
    """
    keyed = True                        # guesses per sequence, stepped by each verify's logits

    def __init__(self, window: int = 4, ngram: int = 3, max_candidates: int = 4,
                 seed: int | None = 0, learn_from_output: bool = True, max_cached_seqs: int = 8):
        _check_int("window", window, 1)
        _check_int("ngram", ngram, 2)          # an n-gram after the root holds N - 1 >= 1 tokens
        _check_int("max_candidates", max_candidates, 1)
        _check_int("max_cached_seqs", max_cached_seqs, 1)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.window, self.ngram, self.max_candidates = window, ngram, max_candidates
        self.seed, self.learn_from_output = seed, learn_from_output
        self.max_cached_seqs = max_cached_seqs
        self.pool_size = max(8, 2 * max_candidates)           # n-grams kept per first token
        self.reset()

    def reset(self) -> None:
        self._seqs: list[_Seq] = []                           # most recently used last
        self._pending: dict[int, tuple] = {}        # id(draft) -> (draft, seq, lookahead nodes)
        self._gen = torch.Generator()
        self._gen.manual_seed(self.seed if self.seed is not None else torch.seed())

    # --- state -------------------------------------------------------------------------------
    def _seq_for(self, context: list[int], key=None) -> _Seq:
        """The state of this sequence (by key, else the one whose context this one extends),
        brought up to date: guesses shifted past the new tokens and refilled to W."""
        def extends(s):
            return len(s.context) <= len(context) and context[:len(s.context)] == s.context
        s = next((s for s in reversed(self._seqs)
                  if (s.key == key if key is not None else s.key is None) and extends(s)), None)
        if s is None:
            if key is not None:                                # a key names one sequence
                self._seqs = [t for t in self._seqs if t.key != key]
            s = _Seq(context, key)
            if len(self._seqs) >= self.max_cached_seqs:
                self._seqs.pop(0)                             # the least recently used
        else:
            self._seqs.remove(s)
        self._seqs.append(s)
        shift = len(context) - s.base                         # tokens appended since the guesses
        s.guesses = s.guesses[shift:][:self.window]
        s.lineage = s.lineage[shift:][:self.window]
        s.base, s.context = len(context), list(context)
        if self.learn_from_output:
            N = self.ngram
            for end in range(max(s.known, N - 1), len(context)):
                self._remember(s, context[end - N + 1:end + 1])
        s.known = len(context)
        while len(s.guesses) < self.window:                   # refill: the pool, else the context
            grams = s.pool.get(s.guesses[-1] if s.guesses else context[-1])
            if grams:
                s.guesses += list(grams[-1])
            else:
                i = int(torch.randint(len(context), (1,), generator=self._gen))
                s.guesses.append(context[i])
            s.lineage += [(t,) for t in s.guesses[len(s.lineage):]]
        del s.guesses[self.window:], s.lineage[self.window:]
        return s

    def _remember(self, s: _Seq, gram: list[int]) -> None:
        """Put an N-gram into the pool under its first token (newest last, at most pool_size)."""
        grams = s.pool.setdefault(gram[0], [])
        rest = tuple(gram[1:])
        if rest in grams:
            grams.remove(rest)
        grams.append(rest)
        del grams[:-self.pool_size]

    def _jacobi_step(self, s: _Seq, inputs: list[tuple[int, ...]], best: list[int]) -> None:
        """best[i] = the argmax at the chain node of depth i: the new guess for depth i + 1;
        inputs[i] = the lineage of that node's token (the tokens that led to it, newest last)."""
        lineage = [(lin + (b,))[-self.ngram:] for lin, b in zip(inputs, best)]
        for gram in lineage:
            if len(gram) == self.ngram:               # each token the argmax after the one before
                self._remember(s, list(gram))
        s.guesses = best + s.guesses[len(best):]
        s.lineage = lineage + s.lineage[len(best):]

    def candidates(self, s: _Seq, root: int) -> list[tuple[int, ...]]:
        """Up to G pool n-grams that followed `root`, newest first."""
        return s.pool.get(root, [])[::-1][:self.max_candidates]

    # --- the tree form -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose_tree(self, context_ids, features=None, tree=None, key=None) -> TreeDraft:
        """context (S,) -> a TreeDraft of at most 1 + W + G (N - 1) nodes, in breadth-first order.
        `features` is not read (needs_features is False) and `tree` is ignored: lookahead builds
        its own shape (the parents say it)."""
        ids = context_ids if isinstance(context_ids, torch.Tensor) else [list(context_ids)]
        context = _contexts(ids)[0]
        s = self._seq_for(context, key)
        root = context[-1]
        children: list[dict[int, int]] = [{}]                # trie: node -> {token: child}
        tokens = [root]

        for path in [s.guesses, *self.candidates(s, root)]:
            node = 0
            for t in path:
                if t not in children[node]:
                    children[node][t] = len(tokens)
                    tokens.append(t)
                    children.append({})
                node = children[node][t]
        order, parents, new = [0], [-1], {0: 0}              # renumber breadth first
        for node in order:
            for child in children[node].values():
                new[child] = len(order)
                order.append(child)
                parents.append(new[node])
        draft = TreeDraft(torch.tensor([tokens[i] for i in order]), parents)   # (N,)
        self._pending[id(draft)] = (draft, s)
        while len(self._pending) > self.max_cached_seqs:     # drafts never observed are dropped
            del self._pending[next(iter(self._pending))]
        return draft

    @torch.inference_mode()
    def observe(self, draft: TreeDraft, logits: torch.Tensor, accepted=None) -> None:
        """One Jacobi step from the verify pass of `draft`: logits (N, V), one row per node.
        `draft` is one this proposer returned, or a cut of it (a loop may prune a tree to its
        budget: the newest pending draft with the same root stands for it); the guess chain is
        found by its tokens, and a cut chain steps only the guesses it still holds. A draft it
        never made (a loop verifying the root alone) teaches nothing and is ignored. `accepted`
        is not needed: the next context says how many tokens to shift past."""
        if logits.dim() != 2 or logits.shape[0] != len(draft.tokens):
            raise ValueError(f"logits must be (N, V) with N = {len(draft.tokens)} nodes, got "
                             f"{tuple(logits.shape)}")
        key = id(draft) if self._pending.get(id(draft), (None,))[0] is draft else next(
            (k for k, (d, _) in reversed(self._pending.items()) if d.tokens[0] == draft.tokens[0]),
            None)
        if key is None:               # not drafted here (a loop's root-only last step): no guesses
            return
        _, s = self._pending.pop(key)
        tokens = draft.tokens.tolist()
        chain = [0]                                          # the guesses' path, found by token
        for g in s.guesses:
            child = next((c for c in range(chain[-1] + 1, len(tokens))
                          if draft.parents[c] == chain[-1] and tokens[c] == g), None)
            if child is None:
                break
            chain.append(child)
        best = logits[chain].argmax(-1).tolist()                                  # (W + 1,)
        root = tuple(s.context[-(self.ngram - 1):])          # real tokens: the root's own lineage
        self._jacobi_step(s, [root] + s.lineage[:len(chain) - 1], best)

    # --- the chain form ----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, contexts, k: int, temperature: float = 0.0, top_k=None, top_p=None,
                generator=None, key=None) -> Proposal:
        """(B,) contexts -> Proposal with token_ids (B, k), probs None (one-hot drafts, exact at
        any temperature): the newest pool n-gram after the last token continued by the guesses,
        else the guesses; num_proposed = min(k, what that gives), the rest padding."""
        contexts, _ = _contexts(contexts), _check_k(k)
        rows, counts = [], []
        for ctx in contexts:
            s = self._seq_for(ctx, key)
            cands = self.candidates(s, ctx[-1])
            drafts = list(cands[0]) + s.guesses[len(cands[0]):] if cands else list(s.guesses)
            drafts = drafts[:k]
            counts.append(len(drafts))
            rows.append(drafts + [drafts[-1]] * (k - len(drafts)))
        return Proposal(torch.tensor(rows), None, torch.tensor(counts))

    @torch.inference_mode()
    def observe_chain(self, context_ids, draft_ids, logits: torch.Tensor, key=None) -> None:
        """The Jacobi step for the chain form, when the caller has the verify logits: context
        (S,) as passed to `propose`, its drafts (k,), logits (k + 1, V) at [last token, drafts]."""
        context, drafts = list(context_ids), [int(t) for t in draft_ids]
        if logits.dim() != 2 or logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"logits must be (k + 1, V) with k = {len(drafts)}, got "
                             f"{tuple(logits.shape)}")
        s = next((s for s in self._seqs if s.key == key and s.context == context), None)
        if s is None:
            raise ValueError("observe_chain: context must be one this proposer drafted for last")
        chain, N = context[-(self.ngram - 1):] + drafts, self.ngram
        inputs = [s.lineage[j - 1] if 0 < j <= len(s.guesses) and s.guesses[j - 1] == t
                  else tuple(chain[:N - 1 + j][-(N - 1):]) for j, t in enumerate([None] + drafts)]
        self._jacobi_step(s, inputs, logits.argmax(-1).tolist())
