"""`make demo`'s chapter 11 part: the chat questions served by one engine split over 3 processes
(tensor parallelism over torch.distributed: gloo on a CPU), against one process; greedy, so the
answers must be identical. Prints tokens/s of both, and one decode step's collectives beside
the formula that predicts them.

    from minillm.lab.parallel_demo import run_parallel_demo
    run_parallel_demo(model, tokenizer)

Left out on purpose: the disaggregated server (`python -m minillm serve --disaggregated`) and
pipeline parallelism; chapter 11 runs both.
"""
import time
import warnings

from minillm.analysis.parallel_math import tp_collectives
from minillm.distributed.tensor_parallel import allowed_sizes
from minillm.distributed.tp_runner import TensorParallelRunner
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.model_runner import ModelRunner
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.prompts import DEMO_QUESTIONS
from minillm.model.chat import encode_chat


def _timed(engine: LLMEngine, prompts, params) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0


def run_parallel_demo(model, tokenizer, max_tokens: int = 24) -> dict:
    """Greedy answers with tensor_parallel_size 1 and the largest size the model allows (up to
    4); returns {size: {seconds, tokens, outputs}} and whether the outputs are identical."""
    cfg = model.config
    n = max(s for s in allowed_sizes(cfg) if s <= 4)
    prompts = [encode_chat(tokenizer, q) for q in DEMO_QUESTIONS[:3]]
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[tokenizer.eos_token_id])
    print(f"\n{'tensor_parallel_size':<21} {'processes':>9} {'tokens':>7} {'tok/s':>9}")
    result = {}
    for size in sorted({1, n}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # more ranks than cores: the numbers show it
            engine = LLMEngine(model, EngineConfig(max_num_seqs=len(prompts), tensor_parallel_size=size),
                               runner=TensorParallelRunner if size > 1 else ModelRunner)
        try:
            outs, seconds = _timed(engine, prompts, params)
            comm = getattr(engine.runner, "comm", None)
            calls = comm.stats.get("all_reduce", {}).get("calls", 0) if comm else 0
        finally:
            engine.shutdown()
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"{size:<21} {size:>9} {tokens:>7} {tokens / seconds:>9.1f}")
        result[size] = {"seconds": seconds, "tokens": tokens, "all_reduces": calls,
                        "outputs": [o.token_ids for o in outs]}
    same = result[1]["outputs"] == result[n]["outputs"]
    per_step = tp_collectives(cfg, n, 1, 1)["all_reduce"]["calls"]
    print(f"tensor_parallel_size={n}: identical outputs: {same}; {per_step} all-reduces per step "
          f"(2 per layer + the embedding's), {result[n]['all_reduces']} in all; "
          f"{result[1]['seconds'] / result[n]['seconds']:.2f}x the speed of one process on this machine")
    result["same"] = same
    return result
