"""`Proposer`: the one interface every drafter offers the speculative loops and the engine.

Letters: B contexts, K draft tokens, V vocab, N tree nodes (root included).

A proposer drafts K tokens after each context (`propose`), a token tree (`propose_tree`), or
both (the engine drafts chains for requests whose logits are processed). The class attributes say
what else it needs, with the defaults of a drafter that needs nothing (n-gram lookup); the engine
(decoder.py) and the batch-1 loops (loop.py, tree_loop.py) read them directly, so every proposer
subclasses this class.

Left out on purpose: a registry of drafters (methods.py names the engine's) and batching several.
"""


class Proposer:
    needs_features: bool = False     # reads the target's hidden rows: propose(..., features=...)
    feature_window: int = 1          # rows per sequence it reads (S-1-w..S-2), if it needs them
    max_rank: int | None = None      # top-k candidates it ranks per tree node (None: any number)
    vocab_size: int | None = None    # its vocabulary when it has its own (None: the target's)
    keyed: bool = False              # state per sequence: takes key=seq_id; observes each verify

    def propose(self, contexts, k: int, temperature: float = 0.0, top_k=None, top_p=None,
                generator=None, **kw):
        """(B,) contexts -> a `Proposal` (proposers.py) of K drafts per context. The engine adds
        `features` (one (w, C) tensor or None per context) when `needs_features`, and `key`
        when `keyed`."""
        raise NotImplementedError(f"{type(self).__name__} drafts trees only")

    @property
    def drafts_trees(self) -> bool:
        """Whether it drafts token trees: its class defines `propose_tree`."""
        return type(self).propose_tree is not Proposer.propose_tree

    def propose_tree(self, context_ids: list[int], features, tree, **kw):
        """A `TreeDraft` (tree.py) rooted at the context's last token, shaped like `tree`."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only")

    def observe_chain(self, context_ids, draft_ids, logits, key=None) -> None:
        """The verify logits (K + 1, V) of a chain draft, before any token is kept (keyed
        proposers; by default ignored)."""

    def observe(self, draft, logits, accepted=None) -> None:
        """The verify logits (N, V) of a tree draft and, when known, its accepted path."""

    def reset(self) -> None:
        """Forget what was learned or cached between prompts (by default nothing is kept)."""
