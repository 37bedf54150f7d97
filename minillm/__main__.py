"""`python -m minillm demo`: the main job. Loads the real model, generates for a few prompts
with a progress bar, prints a summary table, writes demo_decode.png (to build/figures/, or to
$MINILLM_FIGURES_DIR, which `make figures` sets to figures/), then serves a mixed workload
through the engine (continuous batching, chunked prefill) and prints its table, and serves
input-grounded prompts with and without n-gram speculative decoding, then the chat questions with
the weights in the shipped file's Q4_1 blocks (chapter 7), and last the model behind the
OpenAI-compatible server: one answer streamed through the official openai client and a short
load with its latency table (chapter 8). `python -m minillm serve` starts that server alone;
`python -m minillm compile-steps` compiles the engine's steps ahead of time (engine/compile_steps.py).
"""
import argparse
import time

import torch
from tqdm.auto import tqdm

from minillm.lab.prompts import DEMO_PROMPTS


def _decode_demo(model, tok, max_new_tokens: int):
    from minillm.model.chat import encode_chat
    from minillm.model.generate import generate
    rows, step_ms = [], []
    for prompt in tqdm(DEMO_PROMPTS, desc="generating", unit="prompt"):
        ids = encode_chat(tok, prompt)
        t0 = time.perf_counter()
        out = generate(model, ids, max_new_tokens, stop_token_ids=[tok.eos_token_id])
        dt = time.perf_counter() - t0
        rows.append((prompt, len(ids), len(out), len(out) / dt, 1e3 * dt / len(out),
                     tok.decode(out, skip_special_tokens=True)))
    print(f"\n{'prompt':<48} {'prompt':>6} {'new':>5} {'tok/s':>7} {'ms/tok':>7}")
    for prompt, n_in, n_out, tps, ms, _ in rows:
        print(f"{prompt[:48]:<48} {n_in:>6} {n_out:>5} {tps:>7.1f} {ms:>7.1f}")
    print()
    for prompt, *_, text in rows:
        print(f"> {prompt}\n  {text.strip()[:200]!r}")
    return rows


def _figure(rows):
    import matplotlib.pyplot as plt
    from minillm.viz.plotting import save_figure
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r[0][:32] for r in rows], [r[4] for r in rows], color="tab:blue")
    ax.set_xlabel("ms per generated token (prefill included)")
    ax.set_title("minillm on SmolLM2-135M-Instruct, batch 1")
    ax.invert_yaxis()
    return save_figure(fig, "demo_decode")


def demo(max_new_tokens: int = 48) -> None:
    from minillm.llm import load_model, routes_summary
    from minillm.viz.plotting import use_headless_backend
    use_headless_backend()
    t0 = time.perf_counter()
    model, tok = load_model()
    print(f"loaded {model.config.name} ({model.config.num_params / 1e6:.1f}M params) on "
          f"{model.device} in {time.perf_counter() - t0:.1f}s, dtype {model.dtype}")
    print(routes_summary(model))
    rows = _decode_demo(model, tok, max_new_tokens)
    print(f"\nwrote {_figure(rows)}")
    from minillm.lab.demo import run_demo, run_drafting_demo, run_quant_demo, run_spec_demo
    from minillm.lab.parallel_demo import run_parallel_demo
    from minillm.lab.serve_demo import run_serve_demo
    run_demo(model, tok)
    run_spec_demo(model, tok)
    run_quant_demo(model, tok)
    run_drafting_demo(model, tok)
    run_parallel_demo(model, tok)
    run_serve_demo(model, tok)


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:                   # the HTTP server has its own flags (vLLM's names)
        from minillm.serve.cli import main as serve_main
        return serve_main(argv[1:])
    if argv[:1] == ["compile-steps"]:           # the engine's compiled steps, ahead of time
        from minillm.engine.compile_steps import main as compile_main
        return compile_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m minillm")
    parser.add_argument("command", choices=["demo", "serve", "compile-steps"],
                        help="demo: the real model served by minillm; serve: the OpenAI-compatible "
                             "server (python -m minillm serve --help); compile-steps: the engine's "
                             "compiled steps, ahead of time (python -m minillm compile-steps --help)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    demo(args.max_new_tokens)


if __name__ == "__main__":
    main()
