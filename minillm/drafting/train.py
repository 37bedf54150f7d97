"""Training drafters on the reader's CPU by self-distillation (chapter 10): `train_medusa`,
`train_eagle`, and the named recipes they follow.

The target answers the training prompts greedily (`distill.py`), one pass records its features,
and the drafter learns to predict the target's own next tokens from them (`objectives.py`):
AdamW, seeded (same seed and thread count -> the same weights), a tqdm bar. A "small" recipe
trains live in a chapter cell; the default "full" one takes a few minutes (`python -m
minillm.drafting train` runs it) and is cached under
`cache_dir() / "drafters"`, keyed by the target's weights fingerprint and the recipe, so the next
call loads it (a corrupt cache file is reported and trained again); `cached_drafter` only looks
it up, so a chapter can use the full drafters when they exist without training them. The
distilled answers (token ids only) are cached there too: Medusa and EAGLE share them.

Left out on purpose: mixed precision, learning-rate schedules beyond a linear warm-down,
multi-process data loading, sampled (temperature > 0) training answers.
"""
import hashlib
import json
import random
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minillm.drafting.data import load_data
from minillm.drafting.distill import Sample, draft_vocab, generate_answers, record_features, token_counts
from minillm.drafting.evaluate import sample_accuracy
from minillm.drafting.objectives import (IGNORE, coverage_vocab, eagle_loss, medusa_targets,
                                         vocab_targets)
from minillm.drafting.prompts import training_prompts
from minillm.model.loading import cache_dir
from minillm.spec.heads import EagleDrafter, MedusaHeads, weights_fingerprint


@dataclass(frozen=True)
class Recipe:
    """Data and optimizer sizes of one training run."""
    n_chat: int | None = None         # chat questions (None: all)
    n_humaneval: int = 32             # HumanEval prompts
    n_stdlib: int | None = None       # standard-library docstring prompts (None: all)
    max_tokens: int = 128             # answer length
    steps: int = 300
    batch_rows: int = 128             # Medusa: feature rows per step; EAGLE: rows per chunk x chunks
    lr: float = 5e-3                  # Medusa's AdamW learning rate
    eagle_lr: float = 1e-3            # EAGLE's
    eagle_chunk: int = 64             # EAGLE: rows per chunk
    eagle_depth: int = 2              # EAGLE: unrolled levels (1: teacher forcing only)
    eagle_noise: float = 0.1          # EAGLE: uniform input noise on the features
    eagle_cls_weight: float = 0.1     # EAGLE: weight of the token loss beside the feature loss
    # Fields added later; left at their defaults they stay out of the cache key, so drafters
    # trained before they existed are still found.
    source: str = "prompts"           # "prompts": the prompt lists above, answered now;
                                      # "data": the shards `build-data` cached (data.py)
    data_tokens: int | None = None    # "data": answer tokens to read (None: every shard there)
    norm_inputs: bool = False         # EAGLE: RMS-normalize feature and token before fusing
    vocab_coverage: float | None = None   # draft vocabulary: the fewest tokens covering this share
                                          # of the training answers (None: the size passed)


# The draft vocabulary: the training answers' most frequent tokens. A head pass over 8,192 rows of
# the lm_head instead of 49,152 is about 6x cheaper on a CPU and, measured on held-out chat, no less
# accurate (a target token outside it is simply never drafted); None: the full lm_head.
DRAFT_VOCAB = 8192

_LATER = {"source": "prompts", "data_tokens": None, "norm_inputs": False, "vocab_coverage": None}

RECIPES = {
    # chat only (the held-out prompts are chat), one engine batch: about a minute with its EAGLE
    # drafter on a quiet 2-core CPU; its answers are the full recipe's first 32 (same length)
    "small": Recipe(n_chat=32, n_humaneval=0, n_stdlib=0, steps=80, batch_rows=128),
    "full": Recipe(n_stdlib=24),
    # the target's own answers to a chat corpus (`python -m minillm.drafting build-data`: the
    # first 170k answer tokens), normalized inputs, about 4.5 passes: tens of minutes on 2 cores
    # (`python -m minillm.drafting train --recipe data`). Its vocabulary stays the 8,192 most
    # frequent: the data's own tokens cover only 0.88 of held-out chat even taken whole (those
    # covering 0.95 of the data: 0.79), while frequency with ties broken by id (BPE's early,
    # common merges) covers 0.91 at 8,192 and 0.97 at 16,384, whose lm_head rows cost twice.
    "data": Recipe(source="data", data_tokens=170_000, steps=6000, batch_rows=128, norm_inputs=True),
}


def _recipe(recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be a Recipe or one of {sorted(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe]


def _recipe_key(recipe: Recipe) -> dict:
    return {k: v for k, v in asdict(recipe).items() if k not in _LATER or v != _LATER[k]}


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


_FEATURES: dict = {}      # (fingerprint, max_tokens, prompt) -> Sample, for this process


def distilled(model, tokenizer, recipe: Recipe, cache: bool = True, progress: bool = True):
    """The recipe's training samples. Answers are cached as token ids per prompt (one file per
    target and answer length), so a recipe whose prompts another recipe of the same answer
    length already answered generates only the missing ones; features are kept
    in memory for the process, so Medusa and EAGLE trained one after the other record them once."""
    prompts = training_prompts(recipe.n_chat, recipe.n_humaneval, recipe.n_stdlib)
    fp = weights_fingerprint(model)
    path = cache_dir() / "drafters" / f"answers-{fp[:16]}-{recipe.max_tokens}.json"
    answers = {}
    if cache and path.is_file():
        try:
            answers = {p: (list(s), int(st)) for p, (s, st) in json.loads(path.read_text()).items()}
        except (ValueError, TypeError, AttributeError) as err:
            warnings.warn(f"{path} is corrupt ({err}); generating the answers again")
    missing = [p for p in prompts if p not in answers]
    if missing:
        answers.update(zip(missing, generate_answers(model, tokenizer, missing, recipe.max_tokens,
                                                     max_num_seqs=min(64, max(16, len(missing))),
                                                     progress=progress)))
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(answers))
    keys = [(fp, recipe.max_tokens, p) for p in prompts]
    todo = [k for k in keys if k not in _FEATURES]
    for k, sample in zip(todo, record_features(model, [answers[k[2]] for k in todo], progress)):
        _FEATURES[k] = sample
    return [_FEATURES[k] for k in keys]


def _cached(cls, model, path, retrain: bool):
    if retrain or not path.is_file():
        return None
    try:
        return cls.load(path, model)
    except ValueError as err:
        warnings.warn(f"{err}; training again")
        return None


def _fit(params, steps: int, lr: float, seed: int, loss_fn, progress: bool, desc: str) -> list[float]:
    """AdamW with a linear warm-down; loss_fn(step, generator) -> scalar. Returns the losses."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    gen, losses = torch.Generator().manual_seed(seed), []
    bar = tqdm(range(steps), desc=desc, disable=not progress)
    for step in bar:
        loss = loss_fn(step, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return losses


def _prepare(model, recipe, kind: str, extra, seed: int, draft_vocab_size):
    """The recipe and the cache path of this training run."""
    recipe = _recipe(recipe)
    if recipe.source not in ("prompts", "data"):
        raise ValueError(f"recipe.source must be 'prompts' or 'data', got {recipe.source!r}")
    key = _key([kind, _recipe_key(recipe), extra, seed, draft_vocab_size])
    path = cache_dir() / "drafters" / f"{kind}-{weights_fingerprint(model)[:16]}-{key}.pt"
    return recipe, path


def training_samples(model, tokenizer, recipe, cache: bool = True, progress: bool = True):
    """The recipe's training `Sample`s: answered now (source "prompts") or read from the
    shards `build-data` cached (source "data"; ValueError saying how to build them if none)."""
    recipe = _recipe(recipe)
    if recipe.source == "prompts":
        return distilled(model, tokenizer, recipe, cache, progress)
    try:
        samples = load_data(model, tokenizer, tokens=recipe.data_tokens)
    except ModuleNotFoundError as err:                  # the corpus package: the data extra
        raise ValueError(f"recipe.source is 'data': {err}") from None
    have = sum(s.ids.numel() - s.start for s in samples)
    if not samples or (recipe.data_tokens is not None and have < recipe.data_tokens):
        raise ValueError(f"recipe.source is 'data' but the drafter data cached for this model holds "
                         f"{have} answer tokens, not {recipe.data_tokens or 1}: build it once with "
                         f"`python -m minillm.drafting build-data --tokens {recipe.data_tokens or 200_000}`")
    return samples


def _vocab(samples, model, draft_vocab_size, recipe):
    if recipe.vocab_coverage is not None:
        counts = token_counts([_as_own(s) for s in samples], model.config.vocab_size)
        return coverage_vocab(counts, recipe.vocab_coverage)
    if draft_vocab_size is None:
        return None
    return draft_vocab([_as_own(s) for s in samples], model.config.vocab_size, draft_vocab_size)


def _as_own(s):
    """The sample with the target's labels as its ids (what the drafter must say)."""
    return s if s.labels is None else Sample(s.labels, s.hidden, s.start)


def _finish(drafter, model, recipe, losses, path, cache: bool, extra: dict | None = None):
    drafter.target_fingerprint = weights_fingerprint(model)
    drafter.meta = {"recipe": asdict(recipe), "losses": losses[::max(1, len(losses) // 50)],
                    "first_loss": losses[0], "last_loss": losses[-1],
                    **(extra or {})}
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        drafter.save(path)
    return drafter.to(model.device, model.dtype).eval()


def train_medusa(model, tokenizer, num_heads: int = 4, recipe="full", seed: int = 0,
                 draft_vocab_size: int | None = DRAFT_VOCAB, cache: bool = True, retrain: bool = False,
                 progress: bool = True, samples=None) -> MedusaHeads:
    """Medusa heads for `model`, trained by self-distillation (or loaded from the cache).
    `samples`: distilled `Sample`s to train on instead of the recipe's prompts (tests)."""
    recipe, path = _prepare(model, recipe, "medusa", num_heads, seed, draft_vocab_size)
    cache = cache and samples is None
    found = _cached(MedusaHeads, model, path, retrain) if cache else None
    if found is not None:
        return found
    samples = samples if samples is not None else training_samples(model, tokenizer, recipe,
                                                                    not retrain, progress)
    vocab = _vocab(samples, model, draft_vocab_size, recipe)
    heads = MedusaHeads(model.config, num_heads, seed=seed, draft_vocab=vocab).to(model.device).float()
    feats, tgts = [], []
    for s in samples:
        rows, tgt = medusa_targets(s, num_heads, s.labels)
        feats.append(s.hidden[rows])
        tgts.append(vocab_targets(tgt, vocab, model.config.vocab_size))
    feats, tgts = torch.cat(feats).float(), torch.cat(tgts)                # (R, C), (R, K)
    if feats.shape[0] == 0:
        raise ValueError("no training rows: the distilled answers are empty")
    lm_head = model.lm_head.weight.detach().float()

    def loss_fn(step, gen):
        idx = torch.randint(feats.shape[0], (recipe.batch_rows,), generator=gen)
        x, y = feats[idx].to(model.device), tgts[idx].to(model.device)
        logits = heads.vocab_logits(heads(x), lm_head)           # (b, K, V)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads.train()
        losses = _fit(heads.parameters(), recipe.steps, recipe.lr, seed, loss_fn, progress,
                      f"training {num_heads} Medusa heads")
    return _finish(heads, model, recipe, losses, path, cache)


def train_eagle(model, tokenizer, recipe="full", seed: int = 0,
                draft_vocab_size: int | None = DRAFT_VOCAB, cache: bool = True, retrain: bool = False,
                progress: bool = True, samples=None, held_out=None,
                eval_every: int | None = None) -> EagleDrafter:
    """An EAGLE drafter for `model`, trained by self-distillation (or loaded from the cache).
    `held_out`: `Sample`s scored every `eval_every` steps and at the end (top-1 / top-5 at
    depths 1-2, `evaluate.sample_accuracy`); the curve goes into `drafter.meta["curve"]`."""
    recipe, path = _prepare(model, recipe, "eagle", None, seed, draft_vocab_size)
    if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
        raise ValueError(f"eval_every must be an int >= 1 or None, got {eval_every!r}")
    cache = cache and samples is None
    found = _cached(EagleDrafter, model, path, retrain) if cache else None
    if found is not None:
        return found
    samples = samples if samples is not None else training_samples(model, tokenizer, recipe,
                                                                    not retrain, progress)
    samples = [s for s in samples if s.ids.numel() >= 3]
    if not samples:
        raise ValueError("no training rows: the distilled answers are empty")
    vocab = _vocab(samples, model, draft_vocab_size, recipe)
    drafter = EagleDrafter(model.config, seed=seed, draft_vocab=vocab,
                           norm_inputs=recipe.norm_inputs).to(model.device).float()
    curve = []

    def score(step):
        drafter.eval()
        acc = sample_accuracy(model, drafter, held_out, depth=2)
        drafter.train()
        curve.append({"step": step, "top1": [round(x, 4) for x in acc["top1"]],
                      "top5": [round(x, 4) for x in acc["top5"]]})
    chunks = max(1, recipe.batch_rows // recipe.eagle_chunk)
    rng = random.Random(seed)
    lm_head = model.lm_head.weight.detach().float()

    def embed(t):
        return F.embedding(t, model.embed.weight.detach().float())

    def loss_fn(step, gen):
        total = 0.0
        for _ in range(chunks):
            s = samples[rng.randrange(len(samples))]
            lo = max(0, s.start - recipe.eagle_chunk // 2)               # chunks over the answer
            a = rng.randrange(lo, s.ids.numel() - 2)
            total = total + eagle_loss(drafter, lm_head, embed, s, a, recipe.eagle_chunk,
                                       recipe.eagle_depth, recipe.eagle_noise,
                                       recipe.eagle_cls_weight, gen, labels=s.labels)
        if held_out and eval_every and step % eval_every == 0:
            score(step)
        return total / chunks

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter.train()
        losses = _fit(drafter.parameters(), recipe.steps, recipe.eagle_lr, seed, loss_fn, progress,
                      "training the EAGLE drafter")
        if held_out:
            score(recipe.steps)
    return _finish(drafter, model, recipe, losses, path, cache, {"curve": curve} if curve else {})


def cached_drafter(model, kind: str, recipe="full", num_heads: int = 4, seed: int = 0,
                   draft_vocab_size: int | None = DRAFT_VOCAB) -> MedusaHeads | EagleDrafter | None:
    """The drafter that `train_medusa` (kind "medusa") or `train_eagle` ("eagle") would load from
    the cache for the same arguments, or None when none is cached. It never trains: a chapter
    cell that must stay short on a first run uses the full recipe once something else has
    trained it, and a smaller recipe until then."""
    if kind not in ("medusa", "eagle"):
        raise ValueError(f"kind must be 'medusa' or 'eagle', got {kind!r}")
    cls, extra = (MedusaHeads, num_heads) if kind == "medusa" else (EagleDrafter, None)
    _, path = _prepare(model, recipe, kind, extra, seed, draft_vocab_size)
    return _cached(cls, model, path, retrain=False)


def with_steps(recipe, steps: int) -> Recipe:
    """A copy of a recipe with another number of steps."""
    return replace(_recipe(recipe), steps=steps)
