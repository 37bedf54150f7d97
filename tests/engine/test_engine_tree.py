"""The paged engine verifying token trees (`speculative_token_tree` with a proposer that has
`propose_tree`) against trusted references, on a tiny float64 model:

- greedy outputs equal `minillm.generate` run alone, over block sizes, chunked prefill, both
  preemption modes and prefix caching, with siblings of rank 1 really accepted;
- after every step, each running sequence's K/V in the paged pool equals what a plain forward over
  its computed tokens writes (the accepted path was moved to consecutive slots), and the features
  handed to the drafter equal a dense forward's hidden rows; blocks balance at the end;
- the switch (spec/tree_choice.py) keeps the tree on flat verify costs and falls back to the
  chain on steep ones, its decision in one line, as tree sizing's predicted speedups say;
- a tree deeper than K or not prefix-closed is refused, naming `speculative_token_tree`.
The law at temperature > 0 is tests/engine/test_engine_tree_law.py.

The stand-in drafter (tree_drafters.py) fills the tree from the target's own greedy
continuation, the right token at a rank set by the context length, so paths end early, late,
and through rank-1 siblings."""
import pytest
import torch

from engine_configs import CONFIGS
from minillm import EagleDrafter, MedusaHeads, generate
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.spec.tree_choice import decide_tree, verify_costs
from minillm.model.kv_cache import KVCache
from tree_drafters import TreeDrafter, model, work  # noqa: F401 (model, work: shared fixtures)
from minillm.spec.tree import TokenTree
from minillm.spec.tree_sizing import predicted_speedup

K = 3
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
# fewer steps overlap with drafts: a smaller pool keeps preemption in the prefix-caching config
CONFIGS = {**CONFIGS, "prefix_cache_swap": dict(CONFIGS["prefix_cache_swap"], num_blocks=17)}
FLAT = {1: 1.0, 64: 1.0}                     # a machine where a pass of 64 costs what 1 does
STEEP = {1: 1.0, 64: 64.0}                   # ... where every token costs the same
pytestmark = pytest.mark.usefixtures("one_thread")


def tree_engine(model, cfg, costs=FLAT, tree=TREE):
    drafter = TreeDrafter(model)
    engine = LLMEngine(model, EngineConfig(**cfg), speculative_config={
        "method": "medusa", "num_speculative_tokens": K, "model": drafter,
        "speculative_token_tree": tree})
    engine.spec.switch.costs = costs
    return engine, drafter


def cache_matches_plain_decoding(engine, model):
    """Each running sequence's computed K/V in the pool == a plain forward's over its tokens, and
    the block manager's record of those tokens is the sequence's."""
    cache, bm = engine.cache, engine.block_manager
    L, Hkv, D = model.config.n_layer, model.config.n_kv_head, model.config.head_dim
    for seq in engine.scheduler.running:
        n = seq.num_computed_tokens
        if not n or seq.seq_id not in bm:
            continue
        ref = KVCache(model.config, 1, n, dtype=torch.float64)
        with torch.no_grad():
            model(torch.tensor([seq.token_ids[:n]]), torch.arange(n), ref)
        slots = bm.slot_mapping(seq.seq_id, 0, n)
        assert bm.token_ids(seq.seq_id)[:n] == seq.token_ids[:n]      # what prefix hashes read
        for pool, want in ((cache.k, ref.k), (cache.v, ref.v)):
            got = pool.view(L, -1, Hkv, D)[:, slots]                          # (L, n, Hkv, D)
            torch.testing.assert_close(got, want[:, 0].transpose(1, 2), atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_plain_decoding(model, work, name):
    prompts, max_tokens, refs = work
    engine, drafter = tree_engine(model, CONFIGS[name])
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == refs
    sw = engine.spec.switch
    assert drafter.trees > 0 and sw.kept.get((1, 1), 0) > 0     # rank-1 siblings were kept
    assert 0 < engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens
    assert drafter.checked > 0 and engine.num_free_blocks == engine.num_blocks
    if "preempt" in name or "swap" in name:
        assert engine.scheduler.num_preemptions > 0


def test_logprobs_of_tree_tokens_are_the_targets(model, work):
    """Each token a tree step emits carries the log-softmax of a dense forward at its place."""
    prompts, _, refs = work
    engine, _ = tree_engine(model, CONFIGS["bs1"])
    out = engine.generate(prompts[:1], SamplingParams(max_tokens=14, logprobs=2))[0].outputs[0]
    assert out.token_ids == generate(model, prompts[0], 14) and engine.spec_stats.num_accepted_tokens
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompts[0] + out.token_ids]))[0], -1)   # (S, V)
    S = len(prompts[0])
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entry) == 2 and entry[tok].rank == 1     # the top 2, the greedy token first
        assert entry[tok].logprob == pytest.approx(float(ref[S - 1 + i, tok]), abs=1e-6)   # fp32


@pytest.mark.parametrize("method", ["medusa", "eagle", "lookahead"])
def test_real_proposers_verify_their_trees_exactly(model, work, method):
    """Seeded random Medusa heads and EAGLE drafter (trees of top-k ranks), lookahead (its own
    tree shape): greedy still equals plain decoding, with trees verified."""
    prompts, max_tokens, refs = work
    drafter = {"medusa": MedusaHeads(model.config, num_heads=K, seed=0).to(torch.float64),
               "eagle": EagleDrafter(model.config, seed=0).to(torch.float64)}.get(method)
    engine = LLMEngine(model, EngineConfig(**CONFIGS["prefix_cache_swap"]), speculative_config={
        "method": method, "num_speculative_tokens": K, "model": drafter,
        "speculative_token_tree": TREE})
    engine.spec.switch.costs = FLAT
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == refs and engine.num_free_blocks == engine.num_blocks
    assert engine.spec.switch.steps > 0                              # tree verifies ran


@pytest.mark.parametrize("name", ["bs3_chunk8", "prefix_cache_swap"])
def test_the_cache_holds_plain_decodings_kv_after_every_step(model, work, name):
    prompts, max_tokens, refs = work
    engine, _ = tree_engine(model, CONFIGS[name])
    rids = [engine.add_request(p, SamplingParams(max_tokens=k)) for p, k in zip(prompts, max_tokens)]
    while engine.has_unfinished_requests():
        engine.step()
        cache_matches_plain_decoding(engine, model)
    assert [engine.requests[r].output().token_ids for r in rids] == refs
    assert engine.num_free_blocks == engine.num_blocks


def test_the_switch_keeps_the_tree_only_where_it_pays(model, work):
    prompts, max_tokens, refs = work
    cfg = dict(CONFIGS["bs1"])
    for costs, keeps in ((FLAT, True), (STEEP, False)):
        engine, drafter = tree_engine(model, cfg, costs)
        engine.spec.switch.probe_steps = 8
        outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
        assert [o.token_ids for o in outs] == refs
        sw = engine.spec.switch
        assert sw.decided and (sw.current is not None) == keeps
        assert sw.line.startswith(f"token tree: {'tree' if keeps else 'chain'} (")
        assert "\n" not in sw.line
        a, tree = sw.acceptance(), TokenTree(TREE)
        tree_wins = predicted_speedup(tree, a, costs) > predicted_speedup(TokenTree.chain(K), a, costs)
        assert tree_wins == keeps


def test_decide_tree_follows_the_predicted_speedups():
    a = {(1, 0): 0.6, (1, 1): 0.3, (2, 0): 0.6, (2, 1): 0.3, (3, 0): 0.6}
    # tau by hand: the chain 1 + .6 + .36 + .216 = 2.176; the tree adds (1,) .3, (0, 1) .18,
    # (1, 0) .18 and (0, 1, 0) .108: 2.944. Speedup = tau * cost(1) / cost(N), N = 4 or 8.
    cases = [(FLAT, True),                          # 2.944 > 2.176
             (STEEP, False),                        # 2.944 / 8 < 2.176 / 4
             ({1: 1.0, 4: 1.2, 8: 2.0}, False),     # 1.472 < 1.813
             ({1: 1.0, 4: 1.2, 8: 1.4}, True)]      # 2.103 > 1.813
    for costs, tree_wins in cases:
        got, line = decide_tree(TokenTree(TREE), K, a, costs)
        assert (got == TokenTree(TREE)) == tree_wins and (got is None) != tree_wins, line
        assert line.startswith(f"token tree: {'tree' if tree_wins else 'chain'} (8 nodes predict")
    # "auto" sizes the tree (tree_sizing.size_tree): wide on FLAT; on STEEP every node costs as
    # much as a token is worth, and one draft (tau 1.6 for 2 tokens: 0.80x) beats the chain of 3
    assert decide_tree("auto", K, a, FLAT)[0].num_nodes > len(TREE) + 1
    assert decide_tree("auto", K, a, STEEP)[0] == TokenTree([(0,)])


@pytest.mark.parametrize("tree, match", [
    ([(0,), (0, 0, 1)], "speculative_token_tree must be prefix-closed"),
    ([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], "speculative_token_tree: path .* deeper than the 3"),
    ([(0,), (2,)], r"speculative_token_tree: path \(2,\) uses a rank >= 2"),
])
def test_a_bad_tree_is_refused(model, tree, match):
    with pytest.raises(ValueError, match=match):
        tree_engine(model, CONFIGS["bs1"], tree=tree)


def test_verify_costs_are_timed_for_the_sizes_sizing_reads(model):
    costs = verify_costs(model, 6, context=8, rounds=1)
    assert sorted(costs) == [1, 2, 4, 6] and all(t > 0 for t in costs.values())
