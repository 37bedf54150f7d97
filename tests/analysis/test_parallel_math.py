"""Communication formulas (minillm/analysis/parallel_math.py) against numbers worked by hand for
SmolLM2-135M (L=30, d=576, V=49152) and Llama-2-70B (L=80, d=8192, V=32000)."""
import pytest

from minillm.analysis.parallel_math import (
    LINK_PRESETS, Link, allgather_time, allreduce_time, bubble_fraction, get_link,
    pp_p2p_bytes, ring_wire_bytes, tp_collectives, tp_comm_time, tp_decode_split)
from minillm.model.config import get_config

SMOL = get_config("smollm2-135m")
L70 = get_config("llama-2-70b")


def test_tp_collectives_for_smollm2_at_tp3():
    got = tp_collectives(SMOL, 3, num_tokens=5, num_logit_rows=1)
    # 2*30 + 1 = 61 all-reduces of 5 x 576 fp32; one all-gather of 1 x 49152/3 fp32
    assert got["all_reduce"] == {"calls": 61, "bytes": 61 * 5 * 576 * 4}
    assert got["all_gather"] == {"calls": 1, "bytes": 16384 * 4}


def test_tp_collectives_pads_an_uneven_vocab_and_tp1_makes_none():
    got = tp_collectives(L70, 3, num_tokens=2, num_logit_rows=2, dtype_bytes=2)
    assert got["all_gather"]["bytes"] == 2 * 10667 * 2             # ceil(32000 / 3) = 10667
    assert got["all_reduce"] == {"calls": 161, "bytes": 161 * 2 * 8192 * 2}
    none = tp_collectives(SMOL, 1, 5, 1)
    assert none["all_reduce"]["calls"] == none["all_gather"]["calls"] == 0


def test_ring_wire_bytes():
    assert ring_wire_bytes("all_reduce", 1200, 3) == pytest.approx(1600)   # 2 * 2/3 * 1200
    assert ring_wire_bytes("all_gather", 100, 4) == 300                    # 3 shards to receive
    assert ring_wire_bytes("send", 100, 2) == 100
    assert ring_wire_bytes("all_reduce", 1200, 1) == 0


def test_alpha_beta_times_by_hand():
    link = Link("test", bandwidth_Bps=1e9, latency_s=1e-5)
    assert allreduce_time(3000, 3, link) == pytest.approx(4 * 1e-5 + 4000 / 1e9)
    assert allgather_time(1000, 3, link) == pytest.approx(2 * 1e-5 + 2000 / 1e9)
    assert allreduce_time(3000, 1, link) == 0


def test_tp_comm_time_sums_the_collectives():
    link = get_link("100gbe")
    want = 61 * allreduce_time(576 * 2, 3, link) + allgather_time(16384 * 2, 3, link)
    assert tp_comm_time(SMOL, 3, 1, link, dtype_bytes=2) == pytest.approx(want)


def test_tp_decode_split_for_llama2_70b():
    nv = {tp: tp_decode_split(L70, tp, 1, "nvlink4") for tp in (1, 4, 8)}
    eth = tp_decode_split(L70, 8, 1, "10gbe")
    assert nv[1].comm_s == 0 and not nv[1].fits and nv[4].fits        # 138 GB > one 80 GiB H100
    assert nv[4].compute_s == pytest.approx(nv[1].compute_s / 4)
    assert nv[8].total_s < nv[4].total_s < nv[1].total_s              # NVLink: TP pays
    assert eth.total_s > nv[1].total_s                                # 10 GbE: TP=8 loses
    assert 0 < nv[8].comm_fraction < 1


def test_bubble_fraction():
    assert bubble_fraction(2, 1) == 0.5
    assert bubble_fraction(2, 4) == pytest.approx(0.2)
    assert bubble_fraction(4, 13) == pytest.approx(3 / 16)
    assert bubble_fraction(1, 7) == 0


def test_pp_p2p_bytes():
    assert pp_p2p_bytes(SMOL, 7, 2, num_logit_rows=7) == {"activations": 7 * 576 * 4,
                                                          "logits": 7 * 49152 * 4}
    assert pp_p2p_bytes(SMOL, 7, 3)["activations"] == 2 * 7 * 576 * 4
    assert pp_p2p_bytes(SMOL, 7, 1, num_logit_rows=7) == {"activations": 0, "logits": 0}


def test_presets_are_sane():
    assert LINK_PRESETS["nvlink4"].bandwidth_Bps == 450e9
    assert get_link("NVLINK4") is LINK_PRESETS["nvlink4"]


@pytest.mark.parametrize("call, name", [
    (lambda: tp_collectives(SMOL, 0, 1, 1), "tp"),
    (lambda: tp_collectives(SMOL, 3, 0, 1), "num_tokens"),
    (lambda: tp_collectives(SMOL, 3, 1, -1), "num_logit_rows"),
    (lambda: tp_collectives(SMOL, 3, 1, 1, dtype_bytes=0), "dtype_bytes"),
    (lambda: ring_wire_bytes("reduce", 1, 2), "kind"),
    (lambda: ring_wire_bytes("all_reduce", 1, 0), "n"),
    (lambda: bubble_fraction(0, 1), "pipeline_parallel_size"),
    (lambda: bubble_fraction(2, 0), "num_microbatches"),
    (lambda: get_link("carrier-pigeon"), "link"),
    (lambda: Link("x", 0, 1e-6), "bandwidth_Bps"),
    (lambda: tp_decode_split(L70, 4, 0, "nvlink4"), "batch"),
    (lambda: pp_p2p_bytes(SMOL, 1, 0), "pipeline_parallel_size"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_cfg_must_be_a_model_config():
    with pytest.raises(TypeError, match="cfg"):
        tp_collectives("smollm2-135m", 3, 1, 1)


def test_figures_draw_from_numbers():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.distributed.collectives import CollectiveTiming, fit_alpha_beta
    from minillm.distributed.pipeline_stage import PipelineTimeline
    from minillm.viz.parallel import (plot_collective_timings, plot_pipeline_timeline,
                                      plot_tp_decode_split)
    tl = PipelineTimeline(2, 2, {(0, 0): (0, 1), (0, 1): (1, 2), (1, 0): (1, 2), (1, 1): (2, 3)})
    assert tl.bubble_fraction() == pytest.approx(1 / 3) == tl.expected_bubble()  # equal stages
    assert tl.stage_idle() == [pytest.approx(1 / 3)] * 2
    rows = [tp_decode_split(L70, tp, 1, link) for link in ("nvlink4", "10gbe") for tp in (4, 8)]
    timings = [CollectiveTiming("all_reduce", n, 2, 1e-4 + n * 1e-9, 1e-4, 3) for n in (64, 4096)]
    for fig in (plot_pipeline_timeline(tl), plot_tp_decode_split(rows),
                plot_collective_timings(timings, fit_alpha_beta(timings))):
        assert fig.axes
        plt.close(fig)
    with pytest.raises(ValueError, match="rows"):
        plot_tp_decode_split([])


def test_the_tp_engine_hands_the_collectives_exactly_the_formula(one_thread):
    """Counted, not assumed: the driver's Comm.stats over a real TP=2 run (a prefill of 5 + 7
    tokens, then two decode steps of 2) equal tp_collectives summed over the steps."""
    import os

    from minillm import LLM, SamplingParams, tiny_model
    model = tiny_model(n_layer=2)                          # 4 query heads, 2 KV heads: TP=2 works
    prompts = [{"prompt_token_ids": list(range(1, 6))}, {"prompt_token_ids": list(range(10, 17))}]
    with LLM(model, tensor_parallel_size=2) as llm:
        runner = llm.llm_engine.runner
        runner.comm.reset_stats()
        llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
        stats, pids = runner.comm.stats, runner.pids
    want = [tp_collectives(model.config, 2, n, num_logit_rows=2) for n in (12, 2, 2)]
    for kind in ("all_reduce", "all_gather"):
        assert stats[kind]["calls"] == sum(w[kind]["calls"] for w in want)
        assert stats[kind]["bytes"] == sum(w[kind]["bytes"] for w in want)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
