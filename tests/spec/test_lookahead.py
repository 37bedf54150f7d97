"""Lookahead (Jacobi) decoding: greedy decoding driven by `LookaheadProposer` equals plain greedy
decoding, token for token, with every tree verified by a trusted reference (the model without a
cache on context + each node's path); the pool lifts tokens per step above 1; bad arguments."""
import doctest

import pytest
import torch

from minillm import LookaheadProposer, generate, speculative_generate, tiny_model
from minillm.spec.tree import TreeDraft


def node_logits(model, context: list[int], draft: TreeDraft) -> torch.Tensor:
    """(N, V): node i's next-token logits after context + the path root -> i, from a plain forward
    (no cache, no tree mask) over every root-to-leaf path at once, right-padded (a causal model
    never reads the padding at the positions it reports); a node's row comes from any leaf below it."""
    parents, N = draft.parents, len(draft.tokens)
    leaves = [i for i in range(N) if i not in parents]
    paths = []                                                  # node ids, root first
    for leaf in leaves:
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    width = len(context) - 1 + max(map(len, paths))
    rows = [context[:-1] + draft.tokens[p].tolist() for p in paths]
    logits = model(torch.tensor([r + [0] * (width - len(r)) for r in rows]))   # (L, width, V)
    out = torch.empty(N, logits.shape[-1])
    for row, path in enumerate(paths):
        out[path] = logits[row, len(context) - 1:len(context) - 1 + len(path)]
    return out                                                                 # (N, V)


def greedy_accept(logits: torch.Tensor, draft: TreeDraft) -> tuple[list[int], int]:
    """Follow the argmax child from the root; (accepted nodes, bonus token)."""
    accepted = [0]
    while True:
        want = int(logits[accepted[-1]].argmax())
        child = next((c for c, p in enumerate(draft.parents)
                      if p == accepted[-1] and int(draft.tokens[c]) == want), None)
        if child is None:
            return accepted, want
        accepted.append(child)


@torch.inference_mode()
def lookahead_greedy(model, proposer, prompt: list[int], n: int, cut=None) -> tuple[list[int], int]:
    """(output tokens, verify steps) of greedy tree decoding with the reference verify; `cut`
    keeps only a draft's first nodes (as a loop does to fit a budget)."""
    out, steps = [], 0
    while len(out) < n:
        context = prompt + out
        draft = proposer.propose_tree(context)
        if cut is not None:
            draft = TreeDraft(draft.tokens[:cut], draft.parents[:cut])
        assert draft.parents[0] == -1 and all(p < i for i, p in enumerate(draft.parents) if i)
        for node in range(len(draft.tokens)):            # siblings carry distinct tokens
            kids = [int(draft.tokens[c]) for c, p in enumerate(draft.parents) if p == node]
            assert len(kids) == len(set(kids))
        logits = node_logits(model, context, draft)
        accepted, bonus = greedy_accept(logits, draft)
        proposer.observe(draft, logits, accepted)
        out += [int(draft.tokens[i]) for i in accepted[1:]] + [bonus]
        steps += 1
    return out[:n], steps


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.mark.parametrize("W,N,G", [(1, 2, 1), (4, 3, 4), (6, 4, 2)])
def test_tree_greedy_equals_plain_greedy(model, one_thread, W, N, G):
    for prompt in ([5, 17, 33, 2], list(range(40, 52)) * 2):
        reference = generate(model, prompt, 40)
        got, steps = lookahead_greedy(model, LookaheadProposer(W, N, G, seed=1), prompt, 40)
        assert got == reference and steps <= 40


def test_a_cut_draft_is_still_observed(model, one_thread):
    prompt = [7, 8, 9, 10] * 6
    got, steps = lookahead_greedy(model, LookaheadProposer(5, 4, 4, seed=0), prompt, 40, cut=4)
    assert got == generate(model, prompt, 40) and steps < 40


def test_jacobi_pool_gives_more_than_one_token_per_step(one_thread):
    """This model's greedy output falls into a cycle (49 7 91 ...): the guesses settle on it and
    the pool drafts whole n-grams of it. Without learning from the output (second proposer),
    every pool n-gram came from the Jacobi guesses alone."""
    model, prompt = tiny_model(seed=0), [7, 8, 9, 10] * 6
    reference = generate(model, prompt, 64)
    for learn, least in ((True, 2.0), (False, 1.4)):
        prop = LookaheadProposer(5, 4, 4, seed=0, learn_from_output=learn)
        got, steps = lookahead_greedy(model, prop, prompt, 64)
        assert got == reference
        assert len(got) / steps > least, (learn, len(got), steps)


def test_chain_form_is_exact_in_the_batch1_loop(model, one_thread):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = generate(model, prompt, 32)
    for prop in (LookaheadProposer(4, 3, 2, seed=0), LookaheadProposer(2, 2, 1, seed=5)):
        assert speculative_generate(model, prop, prompt, 32, num_speculative_tokens=4) == reference


def test_two_sequences_interleaved_keep_their_own_state(model, one_thread):
    """An engine drafts for every sequence, verifies them together, then observes each: keyed
    states and drafts observed out of order still give each sequence exactly its greedy output."""
    prompts = {"a": [5, 17, 33, 2], "b": [7, 8, 9, 10] * 3}
    outs = {k: [] for k in prompts}
    prop = LookaheadProposer(4, 3, 3, seed=0)
    with torch.inference_mode():
        while min(map(len, outs.values())) < 24:
            drafts = {k: prop.propose_tree(prompts[k] + outs[k], key=k) for k in prompts}
            for k in ("b", "a"):
                logits = node_logits(model, prompts[k] + outs[k], drafts[k])
                accepted, bonus = greedy_accept(logits, drafts[k])
                prop.observe(drafts[k], logits, accepted)
                outs[k] += [int(drafts[k].tokens[i]) for i in accepted[1:]] + [bonus]
    for k in prompts:
        assert outs[k][:24] == generate(model, prompts[k], 24)


def test_observe_chain_steps_the_guesses(model, one_thread):
    """After observe_chain, the drafts after the target's next token are the argmax at the draft
    nodes before them (one Jacobi step), whatever the drafts were."""
    prop, context = LookaheadProposer(3, 2, 1, seed=0), [1, 2, 3, 4]
    drafts = prop.propose([context], 3).token_ids[0].tolist()
    logits = node_logits(model, context, TreeDraft(torch.tensor([4] + drafts), [-1, 0, 1, 2]))
    prop.observe_chain(context, drafts, logits)
    want = int(logits[0].argmax())
    tree = prop.propose_tree(context + [want])
    node = 0
    for t in logits[1:4].argmax(-1).tolist():          # the guess chain is a path of the tree
        node = next(c for c, p in enumerate(tree.parents) if p == node and tree.tokens[c] == t)


@pytest.mark.parametrize("kwargs,name", [
    ({"window": 0}, "window"), ({"window": 2.0}, "window"), ({"ngram": 1}, "ngram"),
    ({"ngram": "3"}, "ngram"), ({"max_candidates": 0}, "max_candidates"),
    ({"max_candidates": True}, "max_candidates"), ({"seed": 1.5}, "seed")])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LookaheadProposer(**kwargs)


def test_observe_rejects_wrong_logits_and_ignores_a_foreign_draft():
    prop = LookaheadProposer(2, 2, 1)
    draft = prop.propose_tree([1, 2, 3])
    with pytest.raises(ValueError, match="logits"):
        prop.observe(draft, torch.zeros(len(draft.tokens) + 1, 8), [0])
    guesses = list(prop._seqs[-1].guesses)
    prop.observe(TreeDraft(torch.tensor([9]), [-1]), torch.zeros(1, 8), [0])   # not drafted here
    assert prop._seqs[-1].guesses == guesses                                     # so ignored


def test_docstring_example():
    import minillm.spec.lookahead as module
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
def test_real_model_tree_greedy_equals_plain_greedy(smollm2):
    from minillm.model.chat import encode_chat
    model, tok = smollm2
    prompt = encode_chat(tok, "Name three colors.")
    reference = generate(model, prompt, 16)
    got, steps = lookahead_greedy(model, LookaheadProposer(3, 3, 2, seed=0), prompt, 16)
    assert got == reference and steps <= 16
