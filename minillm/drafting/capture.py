"""The target's features recorded while it works, for drafter data at scale (chapter 10).

Letters: S tokens of a sequence, C d_model, B sequences of a padded batch, T their length.

`answer_with_features` serves prompts through the engine (greedy, continuous batching: a new
prompt joins as soon as one finishes) and keeps the hidden rows the engine computes anyway:
a tap on the runner calls `ModelRunner.execute_with_hidden` instead of `execute` and files each
scheduled chunk's rows under its request and first position, so no second forward pass is
needed. A finished answer's rows cover positions 0..S-2 (the last sampled token never runs
through the target), so its `Sample` keeps tokens 0..S-2 and drops the last one.

`teacher_force` runs fixed text (a prompt and someone else's answer) through the target in
padded batches and returns each sequence's features and the target's own greedy label at every
position (`objectives.greedy_labels`: labels[t] = argmax of the lm_head at row t - 1): what the
target would have said there, which is what a drafter must learn, not the text's next token.

Left out on purpose: sampled answers, prefix caching while recording (a cached prefix computes
no rows), several layers' features.
"""
import torch

from minillm.drafting.distill import Sample
from minillm.drafting.objectives import greedy_labels
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams


class HiddenTap:
    """An engine runner that also keeps the hidden rows of every step, per request id and
    chunk start (fp16 on the CPU). Everything else is the wrapped runner's."""

    def __init__(self, runner):
        self._runner, self.rows = runner, {}

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, out):
        seqs, logits, hidden = self._runner.execute_with_hidden(out)
        at = 0
        for seq, n in out.scheduled:              # hidden (M, C): chunks in scheduled order
            chunk = hidden[at:at + n].to("cpu", torch.float16)
            self.rows.setdefault(seq.request_id, {})[seq.num_computed_tokens] = chunk
            at += n
        return seqs, logits

    def take(self, request_id: str, num_rows: int, width: int) -> torch.Tensor:
        """Rows of positions 0..num_rows - 1 of a request, (num_rows, C); forgets them."""
        chunks, parts, pos = self.rows.pop(request_id, {}), [], 0
        while pos < num_rows:                     # a recompute after preemption overwrites from 0
            if pos not in chunks:
                raise RuntimeError(f"request {request_id}: no hidden rows recorded at {pos}")
            parts.append(chunks[pos])
            pos += len(chunks[pos])
        return torch.cat(parts)[:num_rows] if parts else torch.zeros(0, width, dtype=torch.float16)


def kv_bytes_per_token(config) -> int:
    return 2 * config.n_layer * config.n_kv_head * config.head_dim * 4      # K and V, fp32


def answer_with_features(model, prompts: list[list[int]], max_tokens: int, stop_token_ids,
                         max_num_seqs: int = 64):
    """Yields (index, Sample) as each prompt's greedy answer finishes (not in input order)."""
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                       enable_prefix_caching=False,
                       kv_cache_memory_bytes=max_num_seqs * (max(map(len, prompts), default=1)
                                                             + max_tokens + 32)
                       * kv_bytes_per_token(model.config))
    engine = LLMEngine(model, cfg)
    tap = engine.runner = HiddenTap(engine.runner)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop_token_ids))
    todo, live = iter(enumerate(prompts)), {}
    for i, p in todo:
        live[engine.add_request(p, params)] = (i, p)
        if len(live) == max_num_seqs:
            break
    while live:
        for o in engine.step():
            if not o.finished:
                continue
            i, p = live.pop(o.request_id)
            ids = p + list(o.token_ids)
            hidden = tap.take(o.request_id, len(ids) - 1, model.config.d_model)   # (S - 1, C)
            yield i, Sample(torch.tensor(ids[:-1]), hidden, len(p))
            nxt = next(todo, None)
            if nxt is not None:
                live[engine.add_request(nxt[1], params)] = nxt


@torch.inference_mode()
def teacher_force(model, texts: list[tuple[list[int], int]], pad_id: int = 0,
                  rows_per_forward: int = 2048) -> list[Sample]:
    """(ids, start) per text -> Samples with fp16 features and the target's greedy labels."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i][0]))
    out: dict[int, Sample] = {}
    i = 0
    while i < len(order):
        B = max(1, rows_per_forward // max(len(texts[order[i]][0]), 1))
        batch = order[i:i + B]
        T = max(len(texts[j][0]) for j in batch)
        x = torch.full((len(batch), T), pad_id, dtype=torch.long)         # (B, T), right padded
        for r, j in enumerate(batch):
            x[r, :len(texts[j][0])] = torch.tensor(texts[j][0])
        _, hidden = model(x.to(model.device), logits_index=torch.tensor([0]), return_hidden=True)
        for r, j in enumerate(batch):                                     # causal: pads unseen
            ids, start = texts[j]
            h, t = hidden[r, :len(ids)], torch.tensor(ids)                # (S, C), (S,)
            out[j] = Sample(t, h.to("cpu", torch.float16), start, greedy_labels(h, model.lm_head, t))
        i += B
    return [out[j] for j in range(len(texts))]
