"""llama.cpp as a peer a chapter can time (chapter 7), when `llama_cpp` imports.

`unavailable()` says why it cannot run here (None when it can); `greedy_run(path, prompt,
threads, max_new)` gives n -> llama.cpp's greedy decode of exactly n new tokens after `prompt`
from a GGUF file: `eval` the prompt's token ids (the ones minillm feeds its own model), then one
token per `eval`, each the argmax of the logits llama.cpp returns (taken in numpy, as minillm's
`generate` takes it in torch), never stopping at end-of-text. Time it beside minillm with
`common.per_token_ms`. The benchmark that records both (`benchmarks/quant_llama_cpp.py`) uses
these two as well.

Left out on purpose: llama.cpp's sampler, batches, prompt processing speed, making other files
(the benchmark does that), and installing llama.cpp (pip builds it from source: the `compare`
extra).
"""
import numpy as np


def unavailable() -> str | None:
    """Why the peer cannot run here (llama_cpp not importable), or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:                 # OSError: the shared library fails to load
        return f"llama_cpp is not importable ({type(e).__name__}: {e}); pip install -e \".[compare]\""
    return None


def greedy_run(path, prompt: list[int], threads: int, max_new: int):
    """n -> llama.cpp's greedy decode of exactly n new tokens (n <= max_new) after `prompt`."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + max_new + 1, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    V = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(V,))
        return int(logits.argmax())

    def run(n: int) -> list[int]:
        if not 1 <= n <= max_new:
            raise ValueError(f"n must be in [1, {max_new}], got {n}")
        llm.reset()                                       # the next eval overwrites the old cache
        llm.eval(prompt)
        out = [next_token()]
        while len(out) < n:
            llm.eval(out[-1:])
            out.append(next_token())
        return out
    run.llm = llm                                         # keeps the model alive beside the closure
    return run
