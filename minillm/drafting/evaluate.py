"""How often trained drafters guess the target's next tokens (chapter 10): top-1 and top-5
accuracy per Medusa head, or per EAGLE depth, on held-out prompts.

Letters: S tokens of a sample, C d_model, K heads (or depths).

A row is a position t of a held-out answer (the target's own greedy tokens). Medusa head k is
right at top-n when token t + 2 + k is among its n best from feature t. EAGLE at depth d drafts
from the true context up to token t + 1 and, from depth 2 on, from its own predicted features
with the true tokens (the path a tree keeps while its guesses are right): right at top-n when
token t + 1 + d is among its n best. Compare with Medusa's published table (Vicuna-7B): top-1
0.56 for head 1 down to 0.12 for head 5; top-5 0.78 down to 0.30.

Left out on purpose: acceptance through the verifier (the loop and engine measure that), sampled
answers.
"""
import torch

from minillm.drafting.distill import generate_answers, record_features
from minillm.drafting.objectives import medusa_targets, unroll
from minillm.spec.heads import EagleDrafter, MedusaHeads

MEDUSA_PUBLISHED = {"top1": [0.56, 0.36, 0.24, 0.17, 0.12],   # Vicuna-7B, heads 1..5 (approx.)
                    "top5": [0.78, 0.62, 0.49, 0.39, 0.30]}


def _hits(logits: torch.Tensor, drafter, tgt: torch.Tensor, n: int) -> torch.Tensor:
    """logits (..., V or Vd), tgt (...) real ids -> (...) bool: target among the n best."""
    top = drafter.token_ids(logits.topk(n, dim=-1).indices)                 # (..., n)
    return (top == tgt[..., None]).any(-1)


@torch.inference_mode()
def sample_accuracy(model, drafter, samples, depth: int | None = None) -> dict:
    """{"top1": [K], "top5": [K], "rows": [K]} over distilled samples."""
    lm_head = model.lm_head
    K = drafter.num_heads if isinstance(drafter, MedusaHeads) else (depth or 4)
    hits = {1: torch.zeros(K), 5: torch.zeros(K)}
    rows = torch.zeros(K)
    dev, dt = model.device, model.dtype
    for s in samples:
        if isinstance(drafter, MedusaHeads):
            r, tgt = medusa_targets(s, K)                                   # (R,), (R, K)
            logits = drafter.logits(s.hidden[r].to(dev, dt), lm_head).cpu()  # (R, K, V)
        else:
            S = s.ids.numel()
            a = max(s.start - 2, 0)                                         # rows whose depth-1
            L = S - 1 - a                                                   # token is an answer
            if L < 1:
                continue
            toks = s.ids[(torch.arange(L + K) + a + 1).clamp(max=S - 1)].to(dev)
            outs = unroll(drafter, s.hidden[a:a + L].to(dev, dt), toks, a, K, model.embed)
            logits = torch.stack([drafter.vocab_logits(o, lm_head) for o in outs], 1).cpu()
            pos = torch.arange(L)[:, None] + a + 2 + torch.arange(K)       # (L, K) predicted
            tgt = s.ids[pos.clamp(max=S - 1)]
            tgt[(pos >= S) | (pos < s.start)] = -100
        ok = tgt >= 0                                                       # (R, K)
        for n in hits:
            hits[n] += (_hits(logits.float(), drafter, tgt, n) & ok).sum(0)
        rows += ok.sum(0)
    den = rows.clamp(min=1)
    return {"top1": (hits[1] / den).tolist(), "top5": (hits[5] / den).tolist(),
            "rows": rows.long().tolist()}


def head_accuracy(model, tokenizer, drafter, prompts: list[str], max_tokens: int = 128,
                  depth: int | None = None, progress: bool = True) -> dict:
    """Top-1 / top-5 accuracy per head (Medusa) or depth (EAGLE, `depth` levels, default 4) on
    the target's greedy answers to `prompts` (held out: e.g. `EVAL_CHAT_PROMPTS`)."""
    if not isinstance(drafter, (MedusaHeads, EagleDrafter)):
        raise TypeError(f"drafter must be MedusaHeads or an EagleDrafter, got {type(drafter).__name__}")
    seqs = generate_answers(model, tokenizer, prompts, max_tokens, progress=progress)
    return sample_accuracy(model, drafter, record_features(model, seqs, progress), depth)
