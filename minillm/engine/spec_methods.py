"""The engine's speculative methods, and what each needs before it can draft: the names, the
checks of a `speculative_token_tree`, and the proposer a trained method drafts with.

Methods: "ngram" and "draft" (chapter 6); "medusa", "eagle" and "lookahead" (chapter 10), which
draft through a *proposer*: `propose(contexts, k, temperature, top_k, top_p, generator=None,
features=None) -> Proposal`, with `needs_features` (then `features` holds one Tensor (w, C) | None
per context: the target's hidden rows at positions S-1-w..S-2), optional `feature_window` (rows
kept per sequence, default 1) and `max_rank` (top-k candidates per node; None: unbounded); one
with `observe_chain` keeps state per sequence (`key=seq_id`). `make_proposer` takes heads, their
file, None (lookahead) or a proposer object. `check_tree` refuses a `speculative_token_tree` that
is not prefix-closed, deeper than K or ranked beyond the drafter ("auto": sized here).

Left out on purpose: training heads (the front door, `LLM`, trains or loads them: this floor
cannot). Trees are checked here and verified by the engine (spec_decoder.py, tree_choice.py).
"""
import os

from minillm.spec.heads import EagleDrafter, MedusaHeads
from minillm.spec.lookahead import LookaheadProposer
from minillm.spec.trained_proposers import EagleProposer, MedusaProposer
from minillm.spec.tree import TokenTree

SPEC_METHODS = ("ngram", "draft", "medusa", "eagle", "lookahead")
TREE_METHODS = ("medusa", "eagle", "lookahead")        # drafters with top-k candidates per node
TRAINED_METHODS = ("medusa", "eagle")                  # need heads trained for the target


def tree_paths(tree) -> tuple | str | None:
    """A `speculative_token_tree` in one form (None, "auto", or a tuple of tuples), unchecked:
    `check_tree` checks it."""
    if tree is None or tree == "auto":
        return tree
    if isinstance(tree, str) or not isinstance(tree, (list, tuple)):
        raise TypeError(f"speculative_token_tree must be None, 'auto' or a list of paths of "
                        f"top-k ranks like [(0,), (1,), (0, 0)], got {tree!r}")
    return tuple(tuple(p) if isinstance(p, list) else p for p in tree)


def check_tree(tree, k: int, max_rank: int | None) -> tuple | str | None:
    """`tree_paths(tree)`, refused by `TokenTree` (ValueError naming speculative_token_tree)
    unless it is a non-empty, prefix-closed set of paths no deeper than K =
    num_speculative_tokens with no rank reaching `max_rank`, the candidates per node the
    drafter produces."""
    paths = tree_paths(tree)
    if isinstance(paths, tuple):
        TokenTree(paths, max_depth=k, max_rank=max_rank)
    return paths


def is_proposer(obj) -> bool:
    return callable(getattr(obj, "propose", None))


def make_proposer(method: str, drafter, target=None, k: int = 1, max_num_seqs: int = 32):
    """The proposer a trained method drafts with, from a speculative_config's "model": a
    proposer object as it is; None for lookahead (a `LookaheadProposer` with state for every
    running sequence); heads (`MedusaHeads`, `EagleDrafter`) or a path to their file, loaded
    against `target` (heads made for another model, or a corrupt file: ValueError)."""
    if method not in TREE_METHODS:
        raise ValueError(f"make_proposer is for methods {list(TREE_METHODS)}, got {method!r}")
    if is_proposer(drafter):
        return drafter
    if method == "lookahead":
        if drafter is not None:
            raise TypeError(f"speculative_config['model'] for method 'lookahead' must be None or "
                            f"a proposer, got {type(drafter).__name__}")
        return LookaheadProposer(max_cached_seqs=2 * max_num_seqs)
    if drafter is None:
        raise ValueError(f"speculative_config['model'] is None: method {method!r} needs trained "
                         f"heads; pass them (an object or a path), or use minillm.LLM, which "
                         f"trains (or loads the cached) heads for the model")
    heads_cls = MedusaHeads if method == "medusa" else EagleDrafter
    if isinstance(drafter, (str, os.PathLike)):
        drafter = heads_cls.load(drafter, target)
    if not isinstance(drafter, heads_cls):
        raise TypeError(f"speculative_config['model'] for method {method!r} must be a "
                        f"{heads_cls.__name__}, a path to one, None or a proposer, got "
                        f"{type(drafter).__name__}")
    if method == "medusa":
        if k > drafter.num_heads:
            raise ValueError(f"num_speculative_tokens={k} needs as many Medusa heads; these "
                             f"have num_heads={drafter.num_heads}")
        proposer = MedusaProposer(target, drafter)
        proposer.feature_window = 1                  # Medusa reads the last feature only
    else:
        proposer = EagleProposer(target, drafter)
        proposer.feature_window = proposer.window    # EAGLE's drafter reads a window of rows
    return proposer
