"""`make demo`'s serving part: a mixed workload through `LLMEngine` on the real model, then a
summary table (per-request TTFT / TPOT / end-to-end, and throughput), static vs continuous; then
input-grounded prompts with and without n-gram speculative decoding (chapter 6); then the chat
questions again with the weights in the shipped file's own Q4_1 blocks (chapter 7); then held-out
chat questions with lookahead drafting, which needs no trained drafter (chapter 10).

    from minillm.lab.demo import run_demo, run_spec_demo, run_quant_demo, run_drafting_demo
    run_demo(model, tokenizer); run_spec_demo(model, tokenizer); run_quant_demo(model, tokenizer)
"""
import numpy as np

from minillm.model.chat import encode_chat
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.prompts import DEMO_QUESTIONS, SPEC_PROMPTS
from minillm.lab.spec_costs import small_batch
from minillm.lab.workloads import poisson_workload, replay


def _summary(label: str, outs, seconds: float) -> str:
    ms = lambda xs: 1e3 * float(np.mean([x for x in xs if x is not None] or [0.0]))
    tokens = sum(len(o.token_ids) for o in outs)
    return (f"{label:<11} {len(outs):>4} {tokens:>7} {tokens / seconds:>9.1f} "
            f"{ms([o.metrics.ttft for o in outs]):>9.0f} {ms([o.metrics.tpot for o in outs]):>9.1f} "
            f"{ms([o.metrics.e2e for o in outs]):>9.0f}")


def run_demo(model, tokenizer, num_requests: int = 12, max_num_seqs: int = 4, seed: int = 0) -> dict:
    """Chat answers through the engine, then a synthetic heavy-tailed workload served with static
    and with continuous batching; prints a table and returns the numbers."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs), tokenizer=tokenizer)
    prompts = [encode_chat(tokenizer, q) for q in DEMO_QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))
    for q, o in zip(DEMO_QUESTIONS, outs):
        answer = tokenizer.decode(o.token_ids, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"Q: {q}\nA: {answer[:160]}\n")
    workload = poisson_workload(num_requests, rate=float("inf"), vocab_size=model.config.vocab_size,
                                seed=seed, prompt_len=(8, 64), output_len=(4, 64))
    print(f"{'scheduling':<11} {'reqs':>4} {'tokens':>7} {'tok/s':>9} {'TTFT ms':>9} "
          f"{'TPOT ms':>9} {'e2e ms':>9}")
    result = {}
    for scheduling in ("static", "continuous"):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, scheduling=scheduling))
        t0 = engine.clock()
        outs = replay(engine, workload)
        seconds = engine.clock() - t0
        print(_summary(scheduling, outs, seconds))
        result[scheduling] = {"seconds": seconds, "steps": len(engine.trace),
                              "tokens": sum(len(o.token_ids) for o in outs)}
    ratio = result["static"]["seconds"] / result["continuous"]["seconds"]
    print(f"continuous / static throughput: {ratio:.2f}x "
          f"({result['static']['steps']} vs {result['continuous']['steps']} engine steps)")
    return result


def run_spec_demo(model, tokenizer, max_tokens: int = 48, k: int = 8) -> dict:
    """Chapter 6 in the engine: the benchmark's input-grounded prompts served together, plain and
    with n-gram drafts (greedy, so the outputs must be identical); prints a table."""
    prompts = [encode_chat(tokenizer, t) for t in SPEC_PROMPTS.values()]
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    r = small_batch(model, prompts, stop, dict(max_new_tokens=max_tokens, k_ngram=k, min_ngram=2,
                                               repeat=1))
    acc = "  ".join(f"{name} {a:.2f}" for name, a in
                    zip(SPEC_PROMPTS, r["ngram"]["acceptance_per_request"]) if a is not None)
    print(f"\n{'decoding':<11} {'steps':>6} {'tokens':>7} {'tok/s':>9}   accepted/drafted per prompt")
    for label, name in (("plain", "plain"), ("ngram", f"n-gram K={k}")):
        x = r[label]
        print(f"{name:<11} {x['steps']:>6} {x['tokens']:>7} {x['tokens_per_s']:>9.1f}   "
              f"{acc if label == 'ngram' else ''}")
    print(f"speculative / plain throughput: {r['speedup']:.2f}x, identical outputs: {r['same_as_plain']}")
    return r


def run_quant_demo(model, tokenizer, max_tokens: int = 32) -> dict:
    """Chapter 7 in the engine: the chat questions with fp32 weights and with the shipped Q4_1
    blocks (`quantize(copy, "gguf")`: the same weights, a third of the bytes, torch's int4 kernel
    where it exists), greedy; prints bytes, tokens/s and whether the answers agree."""
    import copy
    import time
    from minillm.quant.api import quantize, quantized_bytes
    prompts = [encode_chat(tokenizer, q) for q in DEMO_QUESTIONS]
    params = SamplingParams(max_tokens=max_tokens)
    q4 = quantize(copy.deepcopy(model), "gguf")
    print(f"\n{'weights':<11} {'MB':>6} {'tokens':>7} {'tok/s':>9}")
    result = {}
    for name, m in (("fp32", model), ("gguf Q4_1", q4)):
        engine = LLMEngine(m, EngineConfig(max_num_seqs=len(prompts)))
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        mb = quantized_bytes(m)["total"] / 1e6 if m is q4 else sum(
            p.numel() * p.element_size() for p in m.parameters()) / 1e6
        print(f"{name:<11} {mb:>6.0f} {tokens:>7} {tokens / seconds:>9.1f}")
        result[name] = {"seconds": seconds, "tokens": tokens, "outputs": [o.token_ids for o in outs]}
    same = sum(a == b for a, b in zip(result["fp32"]["outputs"], result["gguf Q4_1"]["outputs"]))
    path = q4.layers[0].mlp.down_proj.active_path()
    print(f"int4 / fp32 throughput: {result['fp32']['seconds'] / result['gguf Q4_1']['seconds']:.2f}x "
          f"({path} path; the int4 kernel takes bf16 activations, so a near tie may flip a token: "
          f"{same} of {len(prompts)} answers identical)")
    return result


def run_drafting_demo(model, tokenizer, max_tokens: int = 48, k: int = 4) -> dict:
    """Chapter 10 in the engine: four held-out open chat questions served together, plain and with
    lookahead drafting (`speculative_config={"method": "lookahead"}`: Jacobi guesses and an n-gram
    pool, no trained drafter), greedy, so the answers must be identical; prints a table. Medusa
    and EAGLE need drafters trained on this machine first (chapter 10 trains them)."""
    import time
    from minillm.drafting.prompts import EVAL_CHAT_PROMPTS
    prompts = [encode_chat(tokenizer, q) for q in EVAL_CHAT_PROMPTS[:4]]
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[tokenizer.eos_token_id])
    print(f"\n{'drafting':<11} {'tokens':>7} {'tok/s':>9} {'tokens/step':>12}")
    result = {}
    for name, spec in (("plain", None),
                       ("lookahead", {"method": "lookahead", "num_speculative_tokens": k})):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=len(prompts)), speculative_config=spec)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        m = [o.metrics for o in outs]
        steps = sum(x.num_spec_steps for x in m)
        tau = (sum(x.num_accepted_tokens for x in m) + steps) / steps if steps else 1.0
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"{name:<11} {tokens:>7} {tokens / seconds:>9.1f} {tau:>12.2f}")
        result[name] = {"seconds": seconds, "tokens": tokens, "tau": tau,
                        "outputs": [o.token_ids for o in outs]}
    same = result["plain"]["outputs"] == result["lookahead"]["outputs"]
    print(f"lookahead / plain throughput: {result['plain']['seconds'] / result['lookahead']['seconds']:.2f}x, "
          f"identical outputs: {same}")
    return result