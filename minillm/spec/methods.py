"""The engine's speculative methods, and what each needs before it can draft: the names, the
checks of a `speculative_token_tree`, and the proposer a method other than "ngram" and "draft"
drafts with.

Methods: "ngram" and "draft" (chapter 6); "medusa", "eagle" and "lookahead" (chapter 10). Every
drafter is a `Proposer` (proposer.py: `propose`, and for trees `propose_tree`, with what it needs
as attributes). `make_proposer` takes heads, their file, None (lookahead) or a proposer object.
`check_tree` refuses a `speculative_token_tree` that is not prefix-closed, deeper than K or
ranked beyond the drafter ("auto": sized by tree_choice.py).

Left out on purpose: training heads (the front door, `LLM`, trains or loads them: this floor
cannot). Trees are checked here and verified by the engine (decoder.py, tree_choice.py).
"""
import os

from minillm.spec.heads import EagleDrafter, MedusaHeads
from minillm.spec.lookahead import LookaheadProposer
from minillm.spec.proposer import Proposer
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


def make_proposer(method: str, drafter, target=None, k: int = 1, max_num_seqs: int = 32):
    """The proposer a trained method drafts with, from a speculative_config's "model": a
    proposer object as it is; None for lookahead (a `LookaheadProposer` with state for every
    running sequence); heads (`MedusaHeads`, `EagleDrafter`) or a path to their file, loaded
    against `target` (heads made for another model, or a corrupt file: ValueError). Anything
    else, an object that drafts without subclassing `Proposer` included: TypeError."""
    if method not in TREE_METHODS:
        raise ValueError(f"make_proposer is for methods {list(TREE_METHODS)}, got {method!r}")
    if isinstance(drafter, Proposer):
        return drafter
    if method == "lookahead":
        if drafter is not None:
            raise TypeError(f"speculative_config['model'] for method 'lookahead' must be None or "
                            f"a Proposer, got {type(drafter).__name__}")
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
                        f"{heads_cls.__name__}, a path to one, None or a Proposer, got "
                        f"{type(drafter).__name__}")
    if method == "eagle":
        return EagleProposer(target, drafter)
    if k > drafter.num_heads:
        raise ValueError(f"num_speculative_tokens={k} needs as many Medusa heads; these "
                         f"have num_heads={drafter.num_heads}")
    return MedusaProposer(target, drafter)
