"""Speculative decoding inside the engine: the drafts, proposed before the scheduler runs.

Letters: K draft tokens of one sequence (K <= num_speculative_tokens), V vocab.

`SpecDecoder.propose` gives every decoding sequence (the engine's `Sequence`, read only) up to K
drafts from its `Proposer` (methods.py builds it; a trained drafter reads the target's features,
features.py). The scheduler then books K + 1 tokens, the runner scores them in one ragged pass,
the sampler verifies them exactly, and the engine applies the result. `select` lets speculation
step aside for a step (above `disable_by_batch_size` running requests, below `min_seq_len`
tokens), which leaves every token's law unchanged; `tree_for` gives a sequence a token tree
(tree_choice.py) when its proposer drafts trees. The engine's step calls three methods here:
`draft` before scheduling, `keep_features` and `settle` (rejected drafts rolled back, a tree's
path moved into place, the counts) as a step's results land. Design notes: docs/sources.md.

Left out on purpose: a batched or paged draft-model cache (it runs batch 1), per-request K and
trees.
"""
from dataclasses import dataclass

import torch

from minillm.spec.features import FeatureWindow
from minillm.spec.methods import SPEC_METHODS, check_tree, make_proposer
from minillm.spec.proposers import DraftModelProposer, NgramProposer
from minillm.spec.tree import TokenTree, TreeDraft
from minillm.spec.tree_choice import TreeSwitch


@dataclass
class SpecDecodingStats:
    """Speculative decoding over the engine's whole run (vLLM's name), written by the engine as
    it applies each step. Each request's own share is in its `RequestMetrics` (same names)."""

    num_spec_steps: int = 0        # verify steps (one per sequence that verified drafts)
    num_draft_tokens: int = 0      # drafts proposed and verified
    num_accepted_tokens: int = 0   # drafts kept
    num_steps_speculated: int = 0  # engine steps with decodes in which some sequence could draft
    num_steps_skipped: int = 0     # ... in which speculation stepped aside (plain decodes only)

    @property
    def accepted_fraction(self) -> float:
        """Accepted / drafted tokens (0 before any draft). Not the per-token alpha of the theory
        (`SpecStats.alpha_estimate`), which counts tested drafts only."""
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)


class SpecDecoder:
    def __init__(self, method: str, k: int, draft_model=None, max_seq_len: int | None = None,
                 ngram: tuple[int, int] = (1, 3), max_num_seqs: int = 32, drafter=None,
                 tree=None, target=None, disable_by_batch_size: int | None = None,
                 min_seq_len: int | None = None, max_num_batched_tokens: int = 64):
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_method must be one of {list(SPEC_METHODS)}, got {method!r}")
        if method == "draft" and draft_model is None:
            raise ValueError("speculative_method='draft' needs LLMEngine(..., draft_model=...)")
        self.k, self.method, self.max_seq_len = k, method, max_seq_len
        self.disable_by_batch_size, self.min_seq_len = disable_by_batch_size, min_seq_len
        self.max_tokens = max_num_batched_tokens
        if method == "ngram":
            self.proposer = NgramProposer(min_ngram=ngram[0], max_ngram=ngram[1])
        elif method == "draft":
            self.proposer = DraftModelProposer(draft_model, max_cached_seqs=2 * max_num_seqs)
        else:
            self.proposer = make_proposer(method, drafter, target, k, max_num_seqs)
        max_rank = self.proposer.max_rank
        self.tree = check_tree(tree, k, max_rank)
        # a token tree is verified when one is configured and the proposer drafts trees; the
        # switch probes it and keeps it only if tree sizing predicts it wins here (tree_choice.py)
        self.switch = None
        if self.tree is not None and self.proposer.drafts_trees:
            self.switch = TreeSwitch(self.tree if self.tree == "auto" else TokenTree(self.tree),
                                     k, target, max_rank=max_rank, max_tokens=max_num_batched_tokens)
        self.needs_features = self.proposer.needs_features
        self.feature_window = self.proposer.feature_window
        # a proposer with state per sequence (a draft model's cache, lookahead's guesses) is
        # keyed by seq_id and sees the verify logits (`observe`)
        self.keyed = self.proposer.keyed
        self._trees: dict = {}         # seq_id -> the TreeDraft it verifies (keyed proposers)

    @classmethod
    def from_config(cls, cfg, target, draft_model=None, drafter=None) -> "SpecDecoder":
        """The decoder an `EngineConfig` with num_speculative_tokens > 0 asks for."""
        return cls(cfg.speculative_method or "ngram", cfg.num_speculative_tokens, draft_model,
                   target.config.max_seq_len, ngram=(cfg.prompt_lookup_min, cfg.prompt_lookup_max),
                   max_num_seqs=cfg.max_num_seqs, drafter=drafter, tree=cfg.speculative_token_tree,
                   target=target, disable_by_batch_size=cfg.speculative_disable_by_batch_size,
                   min_seq_len=cfg.speculative_min_seq_len,
                   max_num_batched_tokens=cfg.max_num_batched_tokens)

    def select(self, decoding: list, running: list) -> list:
        """The switch: which of this step's decoding sequences draft. None when the running
        requests reach `disable_by_batch_size`; else those holding >= `min_seq_len` tokens."""
        limit = self.disable_by_batch_size
        if limit is not None and len({s.request_id for s in running}) >= limit:
            return []
        if self.min_seq_len is None:
            return list(decoding)
        return [s for s in decoding if s.num_tokens >= self.min_seq_len]

    def tree_for(self, seq) -> TokenTree | None:
        """The token tree `seq` drafts this step, or None (a chain): the switch's current tree,
        for requests whose rows are the law as the model gives it (no logits processors, grammar
        or min_p: those verify chains, row j processed as after drafts[:j])."""
        if self.switch is None or self.switch.current is None:
            return None
        if seq.needs_processing or seq.params.min_p:
            return None
        return self.switch.current

    def propose(self, seqs: list, draft_generator) -> list[tuple]:
        """Drafts for decoding sequences: one (draft token ids, q, parents) per sequence, q
        (1, K, V) for a sampling draft model, else None; parents: a token tree's (of the newest
        token and the drafts, node order; depth <= K), else None; ([], None, None) where no draft
        fits. `draft_generator(seq)` gives the generator to draft with (the seed rule's,
        `Sampler.draft_generator`). A drafter that reads features gets each sequence's tail
        (features.py; None if it has none)."""
        drafts, self._trees = [], {}
        for seq in seqs:
            p = seq.params
            room = p.max_tokens - len(seq.output_token_ids) - 1       # the bonus token needs room
            if self.max_seq_len is not None:
                room = min(room, self.max_seq_len - seq.num_tokens - 1)
            k = min(self.k, room)
            if k < 1:
                drafts.append(([], None, None))
                continue
            extra = {}
            if self.keyed:
                extra["key"] = seq.seq_id                            # its own cache or state
            feats = None
            if self.needs_features:
                feats = seq.features.tail(seq.num_tokens) if seq.features is not None else None
                extra["features"] = [feats]                          # (w, C) or None
            tree = self.tree_for(seq)
            if tree is not None:
                drafts.append(self._propose_tree(seq, tree, k, feats, extra.get("key")))
                continue
            prop = self.proposer.propose([seq.token_ids], k, p.temperature, p.top_k, p.top_p,
                                         generator=draft_generator(seq), **extra)
            n = k if prop.num_proposed is None else int(prop.num_proposed[0])
            n = min(n, k, prop.token_ids.shape[1])
            probs = prop.probs[:, :n] if prop.probs is not None else None             # (1, K, V)
            drafts.append((prop.token_ids[0, :n].tolist(), probs, None))
        return drafts

    def _propose_tree(self, seq, tree: TokenTree, k: int, feats, key) -> tuple:
        """One sequence's tree draft, cut to depth <= k (the room left), as (ids, None, parents)."""
        extra = {} if key is None else {"key": key}
        draft = self.proposer.propose_tree(seq.token_ids, feats, tree, **extra)
        if not isinstance(draft, TreeDraft) or int(draft.tokens[0]) != seq.token_ids[-1]:
            raise ValueError(f"propose_tree must return a TreeDraft rooted at the context's last "
                             f"token {seq.token_ids[-1]}, got {draft!r}")
        if max(draft.depths) > k:
            draft = draft.prune(k)
        if draft.num_nodes > self.max_tokens:                 # never more than a step's budget
            draft = draft.first(self.max_tokens)
        if self.keyed:
            self._trees[seq.seq_id] = draft                   # for its observe, this step only
        if draft.num_nodes == 1:
            return [], None, None
        return draft.tokens[1:].tolist(), None, list(draft.parents)

    def observe(self, rows, logits: torch.Tensor | None) -> None:
        """Hand a keyed proposer the verify logits of its drafts (K + 1 rows at the last token
        and the drafts), before the engine appends anything: lookahead's Jacobi step."""
        if not self.keyed or logits is None:
            return
        for r in rows:
            if r.num_drafts and r.seq.draft_parents is not None:     # a tree: its own rule
                draft = self._trees.pop(r.seq.seq_id, None)
                if draft is not None and draft.num_nodes == r.num_drafts + 1:
                    self.proposer.observe(draft, logits[r.row:r.row + draft.num_nodes])  # (N, V)
            elif r.num_drafts:
                seq = r.seq
                self.proposer.observe_chain(seq.token_ids, seq.draft_token_ids,
                                            logits[r.row:r.row + r.num_drafts + 1],
                                            key=seq.seq_id)                          # (K+1, V)

    # ---- the engine's step: before scheduling, and as the results land ------------------------
    def draft(self, running: list, draft_generator) -> bool | None:
        """Drafts for the running sequences that decode and that the switch lets draft (`select`),
        before the scheduler books their blocks; the others decode plainly (any drafts from a step
        that did not run them dropped). Returns the step's switch: None (no decodes), True, False."""
        decoding = [s for s in running if s.num_uncomputed == 1 and s.output_token_ids]
        seqs = self.select(decoding, running)
        for seq in decoding:
            seq.clear_drafts()
        for seq, (ids, probs, parents) in zip(seqs, self.propose(seqs, draft_generator)):
            seq.draft_token_ids, seq.draft_probs, seq.draft_parents = ids, probs, parents
        return bool(seqs) if decoding else None

    def keep_features(self, scheduled: list, hidden: torch.Tensor, rows: list, sampled: list) -> None:
        """Each scheduled chunk's hidden rows (M, C) join its sequence's window (features.py), but
        for the rows of rejected drafts. Runs before the counts move (and before any fork)."""
        # rows kept per verifying sequence: a chain's first n - rejected, a tree's path
        kept = {r.seq.seq_id: s.path if s.path is not None else s.num_drafts - s.num_rejected + 1
                for r, s in zip(rows, sampled) if r.num_drafts}
        at = 0
        for seq, n in scheduled:
            if seq.features is None:
                seq.features = FeatureWindow(self.feature_window)
            keep = kept.get(seq.seq_id, n)
            rows_ = hidden[at:at + keep] if isinstance(keep, int) else hidden[[at + i for i in keep]]
            seq.features.extend(seq.num_computed_tokens, rows_)                    # (kept, C)
            at += n

    def settle(self, seq, s, block_manager, counts: tuple) -> list[tuple[int, int]]:
        """K drafts were verified (`s`, the sampler's record): the rejected ones' KV is void
        (num_computed_tokens -= rejected, their slots go back), the rest is registered, and each
        of `counts` (the request's metrics, the engine's stats) adds the step. A token tree's kept
        path first takes the places its nodes were booked in: its tokens in the block table's
        record; returns the K/V moves (src, dst slots) to the slots plain decoding would have
        written, for the engine to make once the step's results are in."""
        moves = []
        if s.path is not None and s.path != list(range(len(s.path))):
            root = seq.num_computed_tokens - 1 - s.num_drafts       # the newest token's position
            slots = block_manager.slot_mapping(seq.seq_id, root, root + 1 + s.num_drafts)
            moves = [(slots[node], slots[j]) for j, node in enumerate(s.path) if node != j]
            block_manager.replace_tokens(seq.seq_id, root + 1, s.token_ids[:-1])
        if s.path is not None and self.switch is not None:     # the tree's probe counts
            self.switch.record(seq.draft_parents, s.path)
        seq.num_computed_tokens -= s.num_rejected
        block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
        block_manager.mark_computed(seq.seq_id, seq.num_computed_tokens)
        seq.clear_drafts()
        for c in counts:
            c.num_spec_steps += 1
            c.num_draft_tokens += s.num_drafts
            c.num_accepted_tokens += s.num_accepted
        return moves
