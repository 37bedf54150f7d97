"""The host KV tier in the engine (EngineConfig.kv_offloading_size, offload_idle_s).

Exactness: greedy (and seeded) outputs are identical with the tier on and off, on a multi-turn
workload with a long shared system prompt and a device pool too small to keep it, through
preemption (recompute and swap), copy-on-write (n > 1) and aborts; the KV a restore writes equals
the KV a run without the tier computes for the same tokens; and hits really happen (stats).
The bookkeeping itself is tested against an emulated memory in test_host_tier.py.
"""
import random

import pytest
import torch

from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.model.loading import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py

TIER_GIB = 0.001          # ~1 MiB: hundreds of the tiny model's 8-token blocks
BASE = dict(block_size=8, num_blocks=16, enable_prefix_caching=True, max_num_batched_tokens=64,
            max_num_seqs=4, offload_idle_s=1e9)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model, tier: bool, **overrides) -> LLMEngine:
    cfg = {**BASE, "kv_offloading_size": TIER_GIB if tier else None, **overrides}
    return LLMEngine(model, EngineConfig(**cfg))


def chat(eng: LLMEngine, params: SamplingParams, turns: int = 3, users: int = 2) -> list:
    """`users` conversations over one 40-token system prompt, a turn each at a time, and a
    100-token unrelated prompt after each round that pushes the system prompt out of the pool."""
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(40)]
    convs, outs = [list(system) for _ in range(users)], []
    for _ in range(turns):
        for c in convs:
            c += [rng.randrange(256) for _ in range(rng.randrange(4, 12))]
        for c, o in zip(convs, eng.generate([list(c) for c in convs], params)):
            outs.append([x.token_ids for x in o.outputs])
            c += o.outputs[0].token_ids
        noise = [rng.randrange(256) for _ in range(100)]
        outs.append(eng.generate([noise], SamplingParams(max_tokens=2, temperature=0))[0]
                    .outputs[0].token_ids)
    return outs


GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.mark.parametrize("mode,idle_s", [("recompute", 1e9), ("swap", 1e9), ("recompute", 0.0)])
def test_outputs_are_identical_with_the_tier(model, mode, idle_s):
    off = engine(model, False, preemption_mode=mode)
    on = engine(model, True, preemption_mode=mode, offload_idle_s=idle_s)
    params = SamplingParams(max_tokens=8, temperature=0)
    assert chat(on, params, users=4) == chat(off, params, users=4)
    stats = on.block_manager.host_tier.stats
    assert stats["restored_blocks"] > 0 and stats["stored_blocks"] > 0
    assert on.scheduler.num_preemptions > 0      # the pool is tight enough to preempt
    assert (stats["idle_offloaded_blocks"] > 0) == (idle_s == 0.0)
    assert off.block_manager.host_tier is None


def test_copy_on_write_and_sampling_are_unchanged(model):
    params = SamplingParams(n=2, max_tokens=5, temperature=0.9, seed=3)
    on, off = engine(model, True), engine(model, False)
    assert chat(on, params, turns=2) == chat(off, params, turns=2)
    assert on.block_manager.stats["cow_copies"] > 0
    assert on.block_manager.host_tier.stats["restored_blocks"] > 0


def test_aborts_mid_run(model):
    def run(eng):
        rng = random.Random(5)
        system = [rng.randrange(256) for _ in range(40)]
        first = [eng.add_request(system + [rng.randrange(256) for _ in range(9)], GREEDY)
                 for _ in range(3)]
        for _ in range(4):
            eng.step()
        eng.abort_request(first[1])                # mid-prefill or mid-decode
        while eng.has_unfinished_requests():
            eng.step()
        eng.generate([[rng.randrange(256) for _ in range(120)]], SamplingParams(max_tokens=1))
        later = [eng.add_request(system + [rng.randrange(256) for _ in range(7)], GREEDY)
                 for _ in range(2)]
        eng.step()
        eng.abort_request(later[0])                # right after its restore
        while eng.has_unfinished_requests():
            eng.step()
        return [eng.requests[r].seqs[0].output_token_ids for r in (first[0], first[2], later[1])]
    on = engine(model, True)
    assert run(on) == run(engine(model, False))
    assert on.block_manager.host_tier.stats["restored_blocks"] > 0


def test_restored_kv_equals_the_recomputed_kv(model):
    rng = random.Random(2)
    prompt = [rng.randrange(256) for _ in range(81)]          # 10 full blocks + 1 token
    on = engine(model, True)
    on.generate([prompt], SamplingParams(max_tokens=1))
    on.generate([[rng.randrange(256) for _ in range(121)]], SamplingParams(max_tokens=1))
    assert on.block_manager.num_evictable_blocks == 15        # the noise's: the prompt's are gone
    assert on.block_manager.num_cached_tokens(prompt) == 80   # all 10 from the host
    rid = on.add_request(prompt + [7], SamplingParams(max_tokens=3))
    before = on.block_manager.host_tier.stats["restored_blocks"]
    on.step()
    assert on.block_manager.host_tier.stats["restored_blocks"] - before == 10
    assert on.requests[rid].metrics.num_cached_tokens == 80
    ref = engine(model, False, num_blocks=64)                 # no tier, no eviction
    ref_rid = ref.add_request(prompt + [7], SamplingParams(max_tokens=3))
    ref.step()
    ref.step()                                                # 64 + 18 prompt tokens
    got = on.block_manager.block_table(on.requests[rid].seqs[0].seq_id)[:10]
    want = ref.block_manager.block_table(ref.requests[ref_rid].seqs[0].seq_id)[:10]
    for pool, ref_pool in ((on.cache.k, ref.cache.k), (on.cache.v, ref.cache.v)):
        assert torch.equal(pool[:, got], ref_pool[:, want])  # (L, 10, P, Hkv, D)


def test_idle_blocks_go_to_the_host_on_the_engine_clock(model):
    now = [100.0]
    eng = engine(model, True, offload_idle_s=2.0, num_blocks=64)
    eng.clock = lambda: now[0]
    prompt = list(range(40))
    eng.generate([prompt], SamplingParams(max_tokens=1))
    tier = eng.block_manager.host_tier
    cached = eng.block_manager.num_evictable_blocks
    assert cached == 5 and tier.num_used == 0
    now[0] += 1.5
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    assert tier.stats["idle_offloaded_blocks"] == 0
    now[0] += 1.0                                             # 2.5 s after the first prompt
    eng.generate([[4, 5, 6]], SamplingParams(max_tokens=1))
    assert tier.stats["idle_offloaded_blocks"] == 5 and tier.num_used == 5
    # the device copies stay findable: the same prompt again hits the device, restores nothing
    eng.generate([prompt], SamplingParams(max_tokens=1))
    assert tier.stats["restored_blocks"] == 0


@pytest.mark.parametrize("field,value,match", [
    ("kv_offloading_size", -1.0, "kv_offloading_size"),
    ("kv_offloading_size", "1", "kv_offloading_size"),
    ("kv_offloading_size", float("nan"), "kv_offloading_size"),
    ("offload_idle_s", -0.5, "offload_idle_s"),
    ("offload_idle_s", None, "offload_idle_s"),
])
def test_bad_config_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(enable_prefix_caching=True, **{field: value})


def test_bad_combinations(model):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_offloading_size=1.0, enable_prefix_caching=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"kv_offloading_size.*more than the host memory"):
        engine(model, True, kv_offloading_size=1e6)          # a petabyte and a bit
    with pytest.raises(ValueError, match="kv_offloading_size.*holds no KV block"):
        engine(model, True, kv_offloading_size=1e-9)
    assert EngineConfig(kv_offloading_size=0).kv_offloading_size == 0   # 0: off, no prefix cache needed


@pytest.mark.slow
def test_real_model_chat_is_identical_and_hits_the_host(smollm2):
    """SmolLM2 with its chat template: one user, two turns after a system prompt that the
    other traffic pushes out of the pool; greedy replies identical with the tier on and off."""
    from minillm.lab.kv_tier import SYSTEM_PROMPT, multi_turn
    model, tokenizer = smollm2
    short = SYSTEM_PROMPT[:SYSTEM_PROMPT.index(" (4)")]        # rules 1-3: about 100 tokens
    res = multi_turn(model, tokenizer, users=1, turns=2, max_tokens=4, block_size=8,
                     system_prompt=short, costs=False)
    assert res["identical"]
    on, off = res["runs"]["on"], res["runs"]["off"]
    assert on["host_hit_blocks"] > 0 and off["host_hit_blocks"] == 0
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"]


def test_serve_flags():
    from minillm.serve.cli import engine_options, parser
    opts = engine_options(parser().parse_args(["--enable-prefix-caching", "--kv-offloading-size",
                                               "0.5", "--offload-idle-s", "3"]))
    cfg = EngineConfig(**opts)
    assert (cfg.kv_offloading_size, cfg.offload_idle_s) == (0.5, 3.0)
    assert EngineConfig(**engine_options(parser().parse_args([]))).kv_offloading_size is None


def test_a_prefilled_handoff_into_an_engine_with_the_tier(model):
    """import_prefilled writes the handed-over rows into fresh blocks at once: blocks it took by
    evicting cached ones must reach the host tier before they are overwritten."""
    from minillm.distributed.kv_transfer import export_prompt_kv, import_prefilled
    rng = random.Random(7)
    a, noise = [rng.randrange(256) for _ in range(60)], [rng.randrange(256) for _ in range(100)]

    def run(tier: bool):
        pre, dec, outs = LLMEngine(model, EngineConfig(num_blocks=64)), engine(model, tier), []
        for i, prompt in enumerate((a, a + [5, 6, 7])):
            outs.append(dec.generate([noise], GREEDY)[0].outputs[0].token_ids)
            rid = pre.add_request(prompt, GREEDY, request_id=f"handoff-{i}")
            while not pre.step():
                pass
            h = export_prompt_kv(pre, rid)
            pre.abort_request(rid)
            import_prefilled(dec, h)
            while dec.has_unfinished_requests():
                dec.step()
            outs.append(dec.requests[rid].seqs[0].output_token_ids)
        outs.append(dec.generate([noise], GREEDY)[0].outputs[0].token_ids)
        return outs, dec
    (on, dec), (off, _) = run(True), run(False)
    assert on == off and dec.block_manager.host_tier.stats["restored_blocks"] > 0
