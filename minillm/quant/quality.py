"""How much a quantized model differs from its reference, on text no one here wrote.

Letters: B sequences, T tokens per sequence, V vocab, n greedy tokens compared.

Texts ship with Python, so every reader has the same bytes: `eval_text()` is four topics of the
Language Reference (`pydoc_data.topics`), only ever measured on; `calibration_text()` is the
docstrings of a dozen standard-library modules, sharing no 8-word run with it (tested), the only
text GPTQ, AWQ and the outlier census see. Metrics against a reference model:
- `perplexity(model, ids)`: exp of the mean next-token NLL over the B*(T-1) predictions.
- `kl_divergence(ref, model, ids)`: mean KL(p_ref || p_model) over B*T positions, in float64.
- `greedy_agreement(ref, model, prompt_ids, n)`: over the reference's n greedy tokens read once
  by the model, the fraction where its argmax agrees ("teacher_forced", the default), and the
  fraction a free-running greedy decode reproduces before it first diverges ("prefix").

Left out on purpose: downstream task accuracy, sampling-based metrics, sliding-window perplexity.
"""
import copy
import math
import importlib

import torch
import torch.nn.functional as F

from minillm._validate import check_int
from minillm.model.generate import generate
from minillm.quant.formats import Int4Weight, Int8Weight
from minillm.quant.targets import check_ids, projections
from minillm.quant.targets import rtn_weights  # noqa: F401 (the chapter calls quality.rtn_weights)

EVAL_TOPICS = ("objects", "execmodel", "exceptions", "types")
CALIBRATION_MODULES = ("re", "statistics", "configparser", "argparse", "json", "csv", "shelve",
                       "wave", "ssl", "hashlib", "cmd")
CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Give three tips for learning to cook.", "Why is the sky blue?")


def eval_text() -> str:
    """Held-out English: Language Reference topics from `pydoc_data.topics`, in a fixed order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in EVAL_TOPICS)


def calibration_text() -> str:
    """Calibration English: standard-library module docstrings, a source apart from the eval text."""
    docs = []
    for name in CALIBRATION_MODULES:
        try:
            doc = importlib.import_module(name).__doc__
        except ImportError:                  # e.g. a Python built without ssl or tkinter
            continue
        if doc:
            docs.append(doc.strip())
    return "\n\n".join(docs)


def text_ids(tokenizer, text: str, n_seqs: int, seq_len: int) -> torch.Tensor:
    """The first n_seqs * seq_len tokens of `text` (no special tokens) as rows: (n_seqs, seq_len)."""
    check_int("n_seqs", n_seqs, 1)
    check_int("seq_len", seq_len, 2)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < n_seqs * seq_len:
        raise ValueError(f"n_seqs * seq_len must be <= {len(ids)} (the text's tokens), "
                         f"got {n_seqs} * {seq_len}")
    return torch.tensor(ids[:n_seqs * seq_len]).view(n_seqs, seq_len)   # (B, T)


def eval_ids(tokenizer, n_seqs: int = 2, seq_len: int = 256) -> torch.Tensor:
    return text_ids(tokenizer, eval_text(), n_seqs, seq_len)


def calibration_ids(tokenizer, n_seqs: int = 8, seq_len: int = 128) -> torch.Tensor:
    return text_ids(tokenizer, calibration_text(), n_seqs, seq_len)


@torch.no_grad()
def _row_logits(model, ids: torch.Tensor):
    """Logits of each row in turn (one row in memory at a time): (T, V) fp32, or fp64 for an fp64 model."""
    for row in ids:
        logits = model(row[None].to(model.device))[0].cpu()            # (T, V)
        yield logits if logits.dtype == torch.float64 else logits.float()


def _scores(model, ids, ref_logits=None):
    """Sum of next-token NLL, sum of KL(ref || model) and the counts, row by row, in float64."""
    nll, kl = 0.0, 0.0
    for b, logits in enumerate(_row_logits(model, ids)):
        lp = F.log_softmax(logits.double(), dim=-1)                     # (T, V)
        nll += -lp[:-1].gather(1, ids[b, 1:, None]).sum().item()
        if ref_logits is not None:
            lp_ref = F.log_softmax(ref_logits[b].double(), dim=-1)      # (T, V)
            kl += (lp_ref.exp() * (lp_ref - lp)).sum().item()
    B, T = ids.shape
    return nll, B * (T - 1), kl, B * T


def perplexity(model, ids) -> float:
    """exp(mean next-token NLL) of `ids` (T,) or (B, T), each row scored on its own."""
    ids = check_ids("ids", ids, model.config.vocab_size, min_len=2)
    nll, n, _, _ = _scores(model, ids)
    return math.exp(nll / n)


def kl_divergence(ref_model, model, ids) -> float:
    """Mean over positions of KL(p_ref || p_model), next-token distributions, in float64 (nats)."""
    ids = check_ids("ids", ids, ref_model.config.vocab_size)
    ref_logits = list(_row_logits(ref_model, ids))
    return _scores(model, ids, ref_logits)[2] / ids.numel()


def reference_continuation(ref_model, prompt_ids, n: int = 32, stop_token_ids=None) -> list[int]:
    """The reference's greedy continuation: n tokens, or fewer when it emits a stop token."""
    return generate(ref_model, list(prompt_ids), n, stop_token_ids=stop_token_ids)


@torch.no_grad()
def greedy_matches(model, prompt_ids, continuation: list[int]) -> torch.Tensor:
    """(n,) bool: does the model's argmax, after the prompt and continuation[:i], equal
    continuation[i]? One teacher-forced pass."""
    ids = list(prompt_ids) + list(continuation)
    x = torch.tensor([ids[:-1]], device=model.device)                  # (1, P + n - 1)
    pred = model(x)[0, len(prompt_ids) - 1:].argmax(-1).cpu()          # (n,)
    return pred == torch.tensor(continuation)


def greedy_agreement(ref_model, model, prompt_ids, n: int = 32, mode: str = "teacher_forced",
                     stop_token_ids=None) -> float:
    """Fraction of the reference's first n greedy tokens the model agrees with (module docstring:
    "teacher_forced" counts every position, "prefix" only those before the first divergence)."""
    check_int("n", n, 1)
    if mode not in ("teacher_forced", "prefix"):
        raise ValueError(f"mode must be 'teacher_forced' or 'prefix', got {mode!r}")
    cont = reference_continuation(ref_model, prompt_ids, n, stop_token_ids)
    return _agreement(greedy_matches(model, prompt_ids, cont))[mode]


def _agreement(matches: torch.Tensor) -> dict:
    misses = (~matches).nonzero()
    prefix = int(misses[0]) if len(misses) else len(matches)
    return {"teacher_forced": matches.float().mean().item(), "prefix": prefix / len(matches)}


def compare(ref_model, models: dict, ids, prompts: list[list[int]], n: int = 32,
            stop_token_ids=None) -> list[dict]:
    """One row per model (the reference first): perplexity, KL to the reference and the mean
    greedy agreement ("agree", teacher forced; "prefix") over the chat prompts. A value of
    `models` may be a zero-argument function that builds the model: it is built when its row is
    measured and dropped after, so only one quantized copy is in memory at a time."""
    ids = check_ids("ids", ids, ref_model.config.vocab_size, min_len=2)
    if not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists")
    ref_logits = list(_row_logits(ref_model, ids))
    conts = [reference_continuation(ref_model, p, n, stop_token_ids) for p in prompts]
    rows = []
    for name, m in {"fp32 (reference)": ref_model, **models}.items():
        m = m() if callable(m) and not isinstance(m, torch.nn.Module) else m
        nll, count, kl, positions = _scores(m, ids, ref_logits)
        agree = [_agreement(greedy_matches(m, p, c)) for p, c in zip(prompts, conts)]
        rows.append({"model": name, "ppl": math.exp(nll / count),
                     "kl": kl / positions,
                     "agree": sum(a["teacher_forced"] for a in agree) / len(agree),
                     "prefix": sum(a["prefix"] for a in agree) / len(agree)})
        del m
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'model':<22} {'ppl':>8} {'KL (nats)':>10} {'agree':>6} {'prefix':>6}"]
    lines += [f"{r['model']:<22} {r['ppl']:>8.3f} {r['kl']:>10.5f} {r['agree']:>6.2f} "
              f"{r['prefix']:>6.2f}" for r in rows]
    return "\n".join(lines)


def projection_names(model) -> list[str]:
    """The four projections of every layer, in forward order ("layers.0.attn.qkv_proj", ...)."""
    return list(projections(model))


@torch.no_grad()
def dequantized_model(model, weights: dict, params: dict | None = None):
    """A copy of `model` whose named linear weights are the dequantized `weights` (Int4Weight,
    Int8Weight or a plain tensor) and whose named parameters take the values in `params`: the
    numerics of "dequantize, then matmul", for measuring quality. `model` is left as it is."""
    own = dict(model.named_parameters())
    new = {f"{k}.weight": v for k, v in weights.items()} | dict(params or {})
    for key, v in new.items():                    # validate everything before copying anything
        if key not in own:
            raise ValueError(f"weights/params name {key!r} is not a parameter of the model")
        shape = v.q.shape if isinstance(v, (Int4Weight, Int8Weight)) else v.shape
        if tuple(shape) != tuple(own[key].shape):
            raise ValueError(f"{key} must have shape {tuple(own[key].shape)}, got {tuple(shape)}")
    out = copy.deepcopy(model)
    mine = dict(out.named_parameters())
    for key, v in new.items():
        v = v.dequantize() if isinstance(v, (Int4Weight, Int8Weight)) else v
        mine[key].copy_(v.to(mine[key].dtype))    # in place: keeps the tuned layout and ties
    return out

