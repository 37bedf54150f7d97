"""Pipeline parallelism (minillm/distributed/pipeline*.py): a model split over 2 processes gives
the single-process model's logits and greedy tokens; the timeline has the shape GPipe's schedule
promises (its measured bubble is printed by the chapter, never asserted: timing decides no test);
bad sizes are refused; no process outlives `shutdown()`."""
import multiprocessing
import os
import signal
import time

import pytest
import torch

from minillm.analysis.parallel_math import pp_p2p_bytes
from minillm.distributed.group import WorkerDied
from minillm.distributed.pipeline import PipelineParallel
from minillm.distributed.pipeline_stage import PipelineStage, balanced_partition, split_layers
from minillm.model.generate import generate_naive
from minillm.model.loading import tiny_model
from procs import alive


def _gone(pids) -> bool:
    children = {p.pid for p in multiprocessing.active_children()}
    return not any(alive(pid) or pid in children for pid in pids)


@pytest.fixture(scope="module")
def model():
    return tiny_model(n_layer=4, seed=1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))  # (B, T)


@pytest.fixture(scope="module")
def pipe(model, one_thread):
    pp = PipelineParallel(model, pipeline_parallel_size=2, threads=1)
    yield pp
    pp.shutdown()
    assert _gone(pp.pids)


def test_split_layers():
    assert split_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split_layers(30, 2, partition=[19, 11]) == [range(0, 19), range(19, 30)]
    assert split_layers(4, 1) == [range(0, 4)]


def test_balanced_partition_counts_lm_head_on_the_last_stage():
    from minillm.model.config import get_config
    smol = get_config("smollm2-135m")            # lm_head: 49152 x 576 = 8.0 layers of 3.54M
    assert balanced_partition(smol, 2) == [19, 11]                     # 19 = 11 + 8
    assert balanced_partition(smol, 2, logits_fraction=0) == [15, 15]  # generation: last row only
    assert balanced_partition(smol, 3) == [13, 12, 5]
    assert balanced_partition(smol, 1) == [30]
    with pytest.raises(ValueError, match="logits_fraction"):
        balanced_partition(smol, 2, logits_fraction=2)


@pytest.mark.parametrize("p", [0, 5, 1.5, True])
def test_bad_pipeline_parallel_size_names_the_range(p):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an int in \[1, 4\]"):
        split_layers(4, p)


@pytest.mark.parametrize("partition", [[1, 2], [4, 0], [2, 1, 1], [2.0, 2]])
def test_bad_partition(partition):
    with pytest.raises(ValueError, match="partition"):
        split_layers(4, 2, partition)


def test_bad_size_is_refused_before_any_process_starts(model):
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        PipelineParallel(model, pipeline_parallel_size=5)
    assert {p.pid for p in multiprocessing.active_children()} == before


@torch.inference_mode()
def test_stages_chained_in_one_process_equal_the_model(model, ids):
    ranges, state = split_layers(4, 3), model.state_dict()
    stages = [PipelineStage(model.config, r, s == 0, s == 2, state) for s, r in enumerate(ranges)]
    x = ids
    for stage in stages:
        x = stage(x)
    assert sum(len(st.layers) for st in stages) == 4 and stages[1].embed is None
    torch.testing.assert_close(x, model(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_pipeline_logits_equal_the_single_model(pipe, model, ids, m):
    logits, timeline = pipe.forward(ids, num_microbatches=m)
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids), rtol=0, atol=1e-5)
    # the structure of GPipe's schedule: p x m intervals; micro-batch i reaches stage 1 only
    # after stage 0 finished it, and each stage takes the micro-batches in order
    rows = timeline.rows()
    assert [(s, i) for s, i, _, _ in rows] == [(s, i) for s in range(2) for i in range(m)]
    iv = timeline.intervals
    for i in range(m):
        assert iv[(1, i)][0] >= iv[(0, i)][1]
        if i:
            assert iv[(0, i)][0] >= iv[(0, i - 1)][1] and iv[(1, i)][0] >= iv[(1, i - 1)][1]
    assert 0 <= timeline.bubble_fraction() < 1
    assert timeline.expected_bubble() == pytest.approx(1 / (m + 1))


def test_the_driver_sends_and_receives_the_formula_bytes(pipe, model, ids):
    torch.set_num_threads(2)
    try:
        pipe.forward(ids, num_microbatches=2)                # stage 0 runs on pipe.threads (1)
        assert torch.get_num_threads() == 2                  # and the driver's setting comes back
    finally:
        torch.set_num_threads(1)
    B, T = ids.shape
    want = pp_p2p_bytes(model.config, B * T, 2, num_logit_rows=B * T)
    s = pipe.last_stats
    assert (s["send"]["calls"], s["send"]["bytes"]) == (2, want["activations"])
    assert (s["recv"]["calls"], s["recv"]["bytes"]) == (2, want["logits"])


@pytest.mark.parametrize("m, use_cache", [(1, True), (2, True), (2, False)])
def test_pipeline_greedy_equals_the_single_model(pipe, model, ids, m, use_cache):
    got = pipe.generate(ids[:2], max_new_tokens=5, num_microbatches=m, use_cache=use_cache)
    assert got == [generate_naive(model, row.tolist(), 5) for row in ids[:2]]
    assert pipe.last_timeline.num_microbatches == m
    logits, _ = pipe.forward(ids)                        # the caches are gone: a plain forward
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids), rtol=0, atol=1e-5)


def test_start_needs_caches(pipe, ids):
    with pytest.raises(ValueError, match="start"):
        pipe.forward(ids, start=3)


def test_bad_inputs_are_refused_and_the_pipeline_still_works(pipe, model, ids):
    with pytest.raises(ValueError, match=r"num_microbatches must be an int in \[1, 4\]"):
        pipe.forward(ids, num_microbatches=5)
    with pytest.raises(ValueError, match=r"token ids in \[0, 256\)"):
        pipe.forward(ids + 256)
    with pytest.raises(ValueError, match="input_ids"):
        pipe.forward(ids[0])
    logits, _ = pipe.forward(ids, num_microbatches=2)
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids), rtol=0, atol=1e-5)


def test_a_model_off_the_cpu_is_refused():
    with pytest.raises(ValueError, match="CPU"):
        PipelineParallel(tiny_model().to("meta"), pipeline_parallel_size=2)


def test_a_killed_worker_is_named_and_nothing_is_left(model, ids, one_thread, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.warns(UserWarning, match="3 stages x 1 thread"):
        pp = PipelineParallel(model, pipeline_parallel_size=3, threads=1)
    pids = pp.pids
    try:
        logits, timeline = pp.forward(ids, num_microbatches=2)
        assert len(timeline.intervals) == 3 * 2
        os.kill(pids[0], signal.SIGKILL)
        for _ in range(100):
            if not pp.group.processes[0].is_alive():
                break
            time.sleep(0.05)
        with pytest.raises(WorkerDied, match=r"rank 1 \(pid \d+\)"):
            pp.forward(ids)
    finally:
        pp.shutdown()
        pp.shutdown()                                    # idempotent
    assert _gone(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        pp.forward(ids)


def test_a_forward_that_fails_midway_shuts_the_pipeline_down(model, ids, one_thread):
    pp = PipelineParallel(model, pipeline_parallel_size=2)

    def broken(*args, **kwargs):
        raise RuntimeError("stage 0 broke")
    pp.stage = broken                                    # fails after the plan went out
    with pytest.raises(RuntimeError, match="stage 0 broke"):
        pp.forward(ids)
    assert _gone(pp.pids)                                # the workers did not wait for ever
    with pytest.raises(RuntimeError, match="shut down"):
        pp.forward(ids)


@pytest.mark.slow
def test_real_smollm2_over_two_processes(one_thread):
    from minillm.model.loading import load_model
    model, _ = load_model(device="cpu")
    x = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with PipelineParallel(model, pipeline_parallel_size=2) as pp:
        logits, _ = pp.forward(x, num_microbatches=2)
        with torch.inference_mode():
            torch.testing.assert_close(logits, model(x), rtol=0, atol=1e-3)  # fp32 sums
        want = generate_naive(model, x[0].tolist(), 6)
        assert pp.generate(x[:1], max_new_tokens=6) == [want]              # KV-cached stages
        pids = pp.pids
    assert _gone(pids)


def test_one_stage_is_the_model_itself(model, ids, one_thread):
    with PipelineParallel(model, pipeline_parallel_size=1) as pp:
        assert pp.pids == []
        logits, timeline = pp.forward(ids, num_microbatches=2)
        assert pp.generate(ids[:1], 3) == [generate_naive(model, ids[0].tolist(), 3)]
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids), rtol=0, atol=1e-5)
    assert timeline.expected_bubble() == 0 and len(timeline.intervals) == 2
