"""Tensor parallelism (distributed/tensor_parallel.py, tp_layers.py, tp_worker.py, tp_runner.py):
shards that put the weights back together, partial sums that add up to the dense layer, the real
SmolLM2 split over 3 processes giving tensor_parallel_size=1's tokens, the collectives a step
costs, sizes refused with the ones that work, an engine without the TP runner sent to the front
door, and no process left behind, even when one dies."""
import multiprocessing
import os
import signal

import pytest
import torch

from minillm.distributed.group import WorkerDied
from minillm.model.generate import generate
from minillm.distributed.tensor_parallel import (allowed_sizes, build_shard,
                                                 check_tensor_parallel_size, full_state,
                                                 shard_config, shard_state_dict)
from minillm.distributed import tp_runner
from minillm.distributed.tp_layers import SoloComm
from minillm.distributed.tp_runner import TensorParallelRunner
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.model_runner import ModelRunner
from minillm.engine.sampling_params import SamplingParams
from minillm.llm import LLM
from minillm.model.config import get_config
from minillm.model.llama import DenseCausalAttention, rope_cos_sin
from minillm.model.loading import tiny_model
from procs import alive

# on a machine with fewer cores than ranks x threads the runner says what that costs (tested below)
pytestmark = pytest.mark.filterwarnings("ignore:tensor_parallel_size=3. 3 ranks run")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]




def _tiny(**kw):
    """SmolLM2's head counts (9 query, 3 KV), a vocab that 3 does not divide (padding)."""
    return tiny_model(vocab_size=101, n_head=9, n_kv_head=3, d_ff=96, **kw)


def test_allowed_sizes_divide_both_head_counts():
    assert allowed_sizes(get_config("smollm2-135m")) == [1, 3]
    assert allowed_sizes(get_config("llama-3-8b")) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*sizes that work: \[1, 3\].*"
                                         r"replicating each KV head"):
        check_tensor_parallel_size(get_config("smollm2-135m"), 2)
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        check_tensor_parallel_size(get_config("smollm2-135m"), 3.0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_shards_put_back_together_equal_the_weights():
    model = _tiny()
    sd, cfg = model.state_dict(), model.config
    shards = [shard_state_dict(sd, cfg, r, 3) for r in range(3)]
    sc = shard_config(cfg, 3)
    assert (sc.n_head, sc.n_kv_head, sc.d_ff, sc.vocab_size) == (3, 1, 32, 34)
    assert shards[0]["layers.0.attn.qkv_proj.weight"].shape == ((3 + 2) * 16, 64)
    assert shards[2]["embed.weight"][-1].abs().sum() == 0          # 3 * 34 = 102 > 101: padding
    back = full_state(shards, cfg)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    tied = _tiny(tie_embeddings=True)
    shard = shard_state_dict(tied.state_dict(), tied.config, 1, 3)
    assert shard["lm_head.weight"] is shard["embed.weight"]            # split once, still shared


def test_each_ranks_partial_sums_add_up_to_the_dense_layer(one_thread):
    """SoloComm reduces nothing, so each rank's layer returns its partial sum; adding them by
    hand is the all-reduce."""
    torch.manual_seed(0)
    model = _tiny(dtype=torch.float64)
    cfg = model.config
    ranks = [build_shard(shard_state_dict(model.state_dict(), cfg, r, 3), cfg, r, 3, SoloComm())
             for r in range(3)]
    x = torch.randn(2, 7, cfg.d_model, dtype=torch.float64)                    # (B, T, C)
    pos = torch.arange(7)[None]
    cos, sin = (t[:, None] for t in rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype))
    dense = DenseCausalAttention()
    attn = sum(m.layers[0].attn(x, cos, sin, dense, 0, pos) for m in ranks)
    torch.testing.assert_close(attn, model.layers[0].attn(x, cos, sin, dense, 0, pos))
    mlp = sum(m.layers[0].mlp(x) for m in ranks)
    torch.testing.assert_close(mlp, model.layers[0].mlp(x))
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    torch.testing.assert_close(sum(m.embed(ids) for m in ranks), model.embed(ids))
    logits = torch.cat([m.lm_head.weight for m in ranks])[:cfg.vocab_size]   # what all_gather joins
    torch.testing.assert_close(x @ logits.T, model.lm_head(x))


def test_speculative_decoding_is_refused_before_any_worker_starts():
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not support speculative"):
        EngineConfig(num_blocks=32, tensor_parallel_size=3, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not support speculative"):
        LLM(_tiny(), tensor_parallel_size=3,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"sizes that work: \[1, 3\]"):
        LLMEngine(_tiny(), EngineConfig(num_blocks=32, tensor_parallel_size=2),
                  runner=TensorParallelRunner)
    assert multiprocessing.active_children() == before


def test_an_engine_without_the_tp_runner_names_the_front_door():
    """The one-process runner starts no workers: LLMEngine alone refuses n > 1 and says what
    does it (LLM, or the runner to pass); n = 1 builds as before."""
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 needs worker processes.*"
                                         r"LLM\(\.\.\., tensor_parallel_size=3\).*"
                                         r"runner=TensorParallelRunner"):
        LLMEngine(_tiny(), EngineConfig(num_blocks=32, tensor_parallel_size=3))
    assert multiprocessing.active_children() == before
    assert type(LLMEngine(_tiny(), EngineConfig(num_blocks=32)).runner) is ModelRunner


def test_more_threads_than_cores_warns_what_it_costs(monkeypatch):
    monkeypatch.setattr(tp_runner, "num_cores", lambda: 2)
    with pytest.warns(UserWarning, match=r"3 ranks run \d+ torch threads on 2 cores.*slower"):
        tp_runner.TensorParallelRunner._warn_if_oversubscribed(3, 1)


def test_swaps_run_on_every_rank_and_a_killed_worker_is_named(one_thread):
    """A pool too small for both requests: swap preemption moves blocks on each rank alike and
    the tokens are plain `generate`'s (a contiguous cache, no swap: a swap-in that wrote nothing
    would show here). Then a worker is killed: the next step names it, and shutdown leaves no
    process."""
    model = _tiny()
    prompts = [[1, 2, 3, 4, 5, 6], [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(max_tokens=20)
    opts = dict(num_blocks=9, block_size=4, preemption_mode="swap", attention_backend="paged")
    want = [generate(model, p, 20) for p in prompts]
    engine = LLMEngine(model, EngineConfig(**opts, tensor_parallel_size=3), runner=TensorParallelRunner)
    pids = engine.runner.pids
    try:
        got = engine.generate(prompts, params)
        assert sum(r.metrics.num_preemptions for r in engine.requests.values()) > 0
        assert [o.outputs[0].token_ids for o in got] == want
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDied, match=r"rank 2 \(pid \d+\) exited with code -9"):
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()
        engine.shutdown()                                            # idempotent
    assert not any(alive(pid) for pid in pids)


@pytest.fixture(scope="module")
def smollm2():
    from minillm.model.loading import load_model
    try:
        return load_model(device="cpu")             # the reference model, plain nn.Linear
    except (OSError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2-135M is not cached: {err}")


def test_three_ranks_give_the_tokens_of_one_on_smollm2(smollm2):
    model, tok = smollm2
    params = SamplingParams(max_tokens=6, logprobs=1)
    opts = dict(attention_backend="paged", num_blocks=64)
    want = LLM(model, tok, **opts).generate(PROMPTS, params, use_tqdm=False)
    with LLM(model, tok, tensor_parallel_size=3, **opts) as llm:
        runner = llm.llm_engine.runner
        pids = runner.pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        runner.comm.reset_stats()
        got = llm.generate(PROMPTS, params, use_tqdm=False)        # batched: one prefill step
        steps, L = llm.llm_engine.step_count, model.config.n_layer
        stats = runner.comm.stats
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4            # fp32, summed in parts
    assert stats["all_reduce"]["calls"] == (2 * L + 1) * steps     # attention + MLP, + embedding
    assert stats["all_gather"]["calls"] == steps                   # the logits, once per forward
    assert not any(alive(pid) for pid in pids)


def test_the_serve_flag_reaches_the_engine_config():
    from minillm.serve.cli import engine_options, parser
    opts = engine_options(parser().parse_args(["--tensor-parallel-size", "3"]))
    assert EngineConfig(**opts).tensor_parallel_size == 3
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(**engine_options(parser().parse_args(["--tensor-parallel-size", "0"])))
