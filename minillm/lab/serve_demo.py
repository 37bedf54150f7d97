"""`make demo`'s chapter-8 part: the real model behind minillm's OpenAI-compatible server on a
free loopback port, one chat answer streamed through the official `openai` client as it arrives,
then a short load from the load generator (`lab/loadgen.py`) and its table. It prints the URL of
the server's live dashboard (`GET /dashboard`), which draws the load while it runs.

    from minillm.lab.serve_demo import run_serve_demo
    run_serve_demo(model, tokenizer)
"""
import time

from minillm.lab.loadgen import benchmark
from minillm.lab.serve_metrics import format_table
from minillm.llm import LLM


def stream_one(base_url: str, model: str, question: str, max_tokens: int = 48) -> dict:
    """Stream one chat answer, printing each piece as it comes; returns the client's timings."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    t0, first, pieces = time.perf_counter(), None, []
    print(f"> {question}\n  ", end="")
    for chunk in client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                                stream=True, messages=[{"role": "user", "content": question}]):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = time.perf_counter() - t0 if first is None else first
            pieces.append(piece)
            print(piece, end="", flush=True)
    total = time.perf_counter() - t0
    print(f"\n  (first text after {1e3 * (first or total):.0f} ms, {len(pieces)} chunks, "
          f"whole answer {1e3 * total:.0f} ms)")
    return {"ttft_s": first, "total_s": total, "chunks": len(pieces), "text": "".join(pieces)}


def run_serve_demo(model, tokenizer, num_prompts: int = 12, request_rate: float = 2.0) -> dict:
    from minillm.serve import running
    llm = LLM(model, tokenizer, max_num_seqs=8)
    print("\nchapter 8: the OpenAI-compatible server (python -m minillm serve), on loopback")
    with running(llm, served_model_name="smollm2-135m") as srv:
        print(f"serving on {srv.base_url}")
        print(f"dashboard: {srv.url}/dashboard (a live page of /metrics; open it while the load runs)")
        result = {"stream": stream_one(srv.base_url, "smollm2-135m", "What is a KV cache?")}
        result["load"] = short_load(srv.base_url, "smollm2-135m", num_prompts, request_rate)
    return result


def short_load(base_url: str, model: str, num_prompts: int, request_rate: float) -> dict:
    """The chapters' prompts at `request_rate` (Poisson), 32 tokens each, streamed; prints the table."""
    print(f"\na short load: {num_prompts} chat requests, Poisson arrivals at {request_rate:g}/s, "
          f"32 tokens each (python -m benchmarks serve --base-url {base_url} ...)")
    run = benchmark(base_url, model, dataset="chapters", num_prompts=num_prompts,
                    request_rate=request_rate, max_tokens=32, ignore_eos=True,
                    goodput=["ttft:2000", "tpot:500"])
    print(format_table(run.summary, "minillm serve"))
    return run.summary
