"""Self-distillation data for drafters (chapter 10): the target answers the training prompts
(`prompts.py`) greedily, and one forward pass per answer records its features.

Letters: S tokens of one sequence (prompt + answer), C d_model.

`generate_answers(model, tokenizer, prompts, max_tokens)` runs minillm's own `LLMEngine`
(batched, greedy, the tokenizer's chat template) and returns each prompt's token ids and the
answer's start. `record_features(model, sequences)` runs the target once over each sequence with
`return_hidden=True` and returns `Sample(ids (S,), hidden (S, C), start)`: hidden row t is the
final norm's output at token t, from which the target's lm_head predicts token t + 1. The
answer tokens are the target's own greedy choices, so a drafter trained on rows t >= start - 1
learns to predict exactly what the target will say.

Left out on purpose: sampled answers (temperature > 0), EAGLE-3's low/middle/high layer features,
storing hidden states on disk (the token ids are small; the features take one pass to remake).
"""
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.model.chat import encode_chat


@dataclass
class Sample:
    """One distilled sequence: ids (S,), the target's features hidden (S, C), answer start, and
    for fixed text the target's greedy label at each position (S,) (None: the ids are its own)."""
    ids: torch.Tensor
    hidden: torch.Tensor
    start: int
    labels: torch.Tensor | None = None


def generate_answers(model, tokenizer, prompts: list[str], max_tokens: int = 128,
                     max_num_seqs: int = 16, progress: bool = True) -> list[tuple[list[int], int]]:
    """Greedy answers through the engine: [(prompt + answer ids, len(prompt ids))] in order."""
    ids = [encode_chat(tokenizer, p) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            stop_token_ids=[tokenizer.eos_token_id])
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    engine = LLMEngine(model, config)
    out, bar = [], tqdm(total=len(ids), desc="distilling answers", disable=not progress)
    for i in range(0, len(ids), max_num_seqs):                   # chunks: the bar moves
        chunk = ids[i:i + max_num_seqs]
        for p, o in zip(chunk, engine.generate(chunk, params), strict=True):
            out.append((p + list(o.outputs[0].token_ids), len(p)))
        bar.update(len(chunk))
    bar.close()
    return out


@torch.inference_mode()
def record_features(model, sequences: list[tuple[list[int], int]],
                    progress: bool = True) -> list[Sample]:
    """One forward pass per sequence -> Samples with the target's features, kept on the CPU
    in float32."""
    out = []
    for ids, start in tqdm(sequences, desc="recording features", disable=not progress):
        x = torch.tensor([ids], device=model.device)                     # (1, S)
        _, hidden = model(x, logits_index=torch.tensor([len(ids) - 1]), return_hidden=True)
        out.append(Sample(torch.tensor(ids), hidden[0].float().cpu(), start))   # (S, C)
    return out


def token_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the answers, (V,): the draft vocabulary's source."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.ids[s.start:], minlength=vocab_size)
    return counts


def draft_vocab(samples: list[Sample], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties by id), sorted by id, (Vd,)."""
    counts = token_counts(samples, vocab_size)
    order = torch.sort(-counts, stable=True).indices[:size]               # ties: lower id first
    return order.sort().values
