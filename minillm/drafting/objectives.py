"""What the drafters learn, row by row (chapter 10), over the `Sample`s of `distill.py`.

Letters: S tokens of a sample, L rows of a training chunk, C d_model, K heads, D unrolled depth.

Medusa: head k reads feature t (hidden row t) and should give token t + 2 + k; only answer tokens
are targets. EAGLE: row i pairs (feature i, token i + 1) at position i + 1 and predicts feature
i + 1, whose lm_head gives token i + 2. `unroll` runs D levels as drafting does: level l row i
reads its own level l - 1 prediction with the true token i + l and sees the true rows up to i and
its earlier levels, so it is exactly the depth-l draft node (EAGLE-3's training-time test).
Targets are `sample.ids` (the target's own answers), or `labels` for fixed text (`greedy_labels`:
the target's argmax at each position), or `soft=True`: the target's distribution at the predicted
feature. `coverage_vocab`: the fewest most frequent tokens covering a share of the data.

Left out on purpose: Medusa-2's soft targets for the heads, EAGLE-3's multi-layer features.
"""
import torch
import torch.nn.functional as F

IGNORE = -100                                           # cross_entropy's ignore_index


def _labels(sample, labels) -> torch.Tensor:
    if labels is None:
        return sample.ids
    labels = torch.as_tensor(labels)
    if labels.shape != sample.ids.shape or labels.dtype != torch.long:
        raise ValueError(f"labels must be token ids shaped like sample.ids {tuple(sample.ids.shape)}"
                         f", got {tuple(labels.shape)} {labels.dtype}")
    return labels


@torch.inference_mode()
def greedy_labels(hidden: torch.Tensor, lm_head, ids: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The target's own greedy token at every position of fixed text: hidden (S, C) its features,
    ids (S,) the text -> labels (S,), labels[0] = ids[0], labels[t] = argmax lm_head(hidden[t-1])."""
    weight = getattr(lm_head, "weight", lm_head)                          # (V, C)
    out = ids.clone()
    for a in range(0, hidden.shape[0] - 1, chunk):                         # (chunk, V) at a time
        h = hidden[a:min(a + chunk, hidden.shape[0] - 1)].to(weight.device, weight.dtype)
        out[a + 1:a + 1 + h.shape[0]] = F.linear(h, weight).argmax(-1).cpu()
    return out


def coverage_vocab(counts: torch.Tensor, coverage: float) -> torch.Tensor:
    """counts (V,) token occurrences -> the fewest token ids (ties: lower id first) whose counts
    sum to >= coverage x the total, sorted by id, (Vd,). Tokens never seen are never chosen."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage!r}")
    if counts.dim() != 1 or int(counts.sum()) <= 0 or int(counts.min()) < 0:
        raise ValueError("counts must be a (V,) tensor of non-negative counts, not all zero")
    order = torch.sort(-counts, stable=True).indices                       # most frequent first
    cum = counts[order].cumsum(0)                                          # (V,)
    need = torch.tensor(coverage, dtype=torch.float64) * int(cum[-1])
    n = int(torch.searchsorted(cum.double(), need - 1e-9)) + 1             # first n with cum >= need
    return order[:n].sort().values


def medusa_targets(sample, num_heads: int, labels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows t (R,), targets (R, K)): answer rows t >= start - 1 and tokens t + 2 + k
    (IGNORE where past the end or not an answer token); tokens from `labels` when given."""
    S = sample.ids.numel()
    rows = torch.arange(max(sample.start - 1, 0), S - 2)                   # (R,)
    pos = rows[:, None] + 2 + torch.arange(num_heads)                      # (R, K)
    tgt = _labels(sample, labels)[pos.clamp(max=S - 1)]
    tgt[(pos >= S) | (pos < sample.start)] = IGNORE
    return rows, tgt


def vocab_targets(tgt: torch.Tensor, draft_vocab: torch.Tensor | None, vocab_size: int):
    """Real token ids -> indices into the drafter's vocabulary (IGNORE when outside it)."""
    if draft_vocab is None:
        return tgt
    where = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    where[draft_vocab.cpu()] = torch.arange(draft_vocab.numel())
    out = torch.full_like(tgt, IGNORE)
    ok = tgt != IGNORE
    out[ok] = where[tgt[ok]]
    return out


def unroll_mask(L: int, depth: int, device=None) -> torch.Tensor:
    """(D L, D L) bool, True = seen: level-1 rows causal; level-l row i sees true rows <= i and
    row i of levels 2..l."""
    i = torch.arange(L, device=device)
    causal = i[None, :] <= i[:, None]                                      # (L, L)
    eye = torch.eye(L, dtype=torch.bool, device=device)
    blocks = [[causal if m == 0 else (eye if 1 <= m <= l else torch.zeros_like(eye))
               for m in range(depth)] for l in range(depth)]
    return torch.cat([torch.cat(row, dim=1) for row in blocks], dim=0)


def unroll(drafter, feats: torch.Tensor, toks: torch.Tensor, start_pos: int, depth: int,
           embed) -> list[torch.Tensor]:
    """feats (L, C) true features of rows i, toks (L + depth,) tokens i + 1 .. of the chunk
    (toks[j] = token of row j + 1), positions start_pos + 1 + i -> predicted features of each
    level, D tensors (L, C): level l row i predicts feature i + l."""
    L = feats.shape[0]
    pos = torch.arange(L, device=feats.device) + start_pos + 1                # (L,)
    outs = []
    for level in range(1, depth + 1):
        f_in = torch.cat([feats] + outs)                                   # (level L, C)
        t_in = torch.cat([toks[m:m + L] for m in range(level)])            # (level L,)
        p_in = torch.cat([pos + m for m in range(level)])
        out = drafter(f_in[None], t_in[None], embed, p_in, unroll_mask(L, level, feats.device))[0]
        outs.append(out[(level - 1) * L:])                                 # (L, C) this level
    return outs


def eagle_loss(drafter, lm_head, embed, sample, a: int, L: int, depth: int, noise: float,
               cls_weight: float, generator: torch.Generator, labels=None, soft: bool = False):
    """Smooth-L1 on the next features + cls_weight x cross-entropy on the next tokens, summed
    over the unrolled levels, for the chunk of rows [a, a + L) of one sample. Token targets:
    `labels` (S,) if given, else sample.ids; `soft`: the target's distribution instead."""
    S = sample.ids.numel()
    L = min(L, S - 1 - a)
    dev = getattr(lm_head, "weight", lm_head).device
    target_ids = _labels(sample, labels).to(dev)
    feats = sample.hidden[a:a + L].to(dev, torch.float32)           # (L, C)
    if noise > 0:                                                          # EAGLE's input noise
        feats = feats + (torch.rand(feats.shape, generator=generator) * 2 - 1).to(dev) * noise
    ids = sample.ids.to(dev)
    toks = ids[(torch.arange(L + depth, device=dev) + a + 1).clamp(max=S - 1)]   # (L + D,)
    outs = unroll(drafter, feats, toks, a, depth, embed)
    rows = torch.arange(L, device=dev) + a
    total = feats.new_zeros(())
    for level, out in enumerate(outs, start=1):
        f_idx = rows + level                                               # feature predicted
        ok_f = f_idx < S
        f_true = sample.hidden.to(dev, torch.float32)[f_idx.clamp(max=S - 1)]
        fl = F.smooth_l1_loss(out[ok_f], f_true[ok_f]) if ok_f.any() else total
        t_idx = rows + level + 1                                           # token predicted
        logits = drafter.vocab_logits(out, lm_head)                        # (L, V or Vd)
        if soft:                                   # the target's distribution at feature i + l
            ok = ok_f & (t_idx >= sample.start)
            with torch.no_grad():
                p = drafter.vocab_logits(f_true[ok], lm_head).softmax(-1)  # (n, V or Vd)
            cl = -(p * logits[ok].log_softmax(-1)).sum(-1).mean() if ok.any() else total
        else:
            tgt = target_ids[t_idx.clamp(max=S - 1)].clone()
            tgt[(t_idx >= S) | (t_idx < sample.start)] = IGNORE
            tgt = vocab_targets(tgt.cpu(), drafter.draft_vocab, drafter.vocab_size).to(dev)
            cl = F.cross_entropy(logits, tgt, ignore_index=IGNORE) if (tgt != IGNORE).any() else total
        total = total + fl + cls_weight * cl
    return total
