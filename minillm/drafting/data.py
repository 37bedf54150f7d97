"""Drafter training data at scale, built once per machine (chapter 10): `build_data` and
`load_data`, behind `python -m minillm.drafting build-data`.

Letters: N tokens of a shard (all its sequences end to end), C d_model.

The prompts are the first exchanges of an offline chat corpus (`corpus.py`). With source
"answers" the target answers them greedily through the engine, its features captured on the way
(`capture.answer_with_features`), so the answers are its own; with "text" the corpus's answers
are teacher-forced and labelled with the target's greedy choices (`capture.teacher_force`).
Shard k holds prompts [k n, (k + 1) n) of the corpus in its order: ids and labels (N,) int32
(labels -1 where the ids are the target's own), features (N, C) fp16 (about 1.2 KB a token),
each sequence's length and answer start. The folder
is `cache_dir() / "drafting-data" / <weights fingerprint>-<key>`, where the key hashes the recipe
and the prompts; a shard is written whole (a temporary file, then a rename), so an interrupted
build resumes at the first missing shard, and a shard that does not load or belongs to another
build is reported in one line and built again. The build stops once the shards hold `tokens`
answer tokens.

Left out on purpose: several processes building one cache, deleting old caches, compression.
"""
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from minillm.drafting.capture import answer_with_features, teacher_force
from minillm.drafting.corpus import Exchange, sharegpt_exchanges
from minillm.drafting.distill import Sample
from minillm.model.chat import encode_chat
from minillm.model.loading import cache_dir
from minillm.spec.heads import weights_fingerprint

FORMAT = 1
SOURCES = ("answers", "text")


@dataclass(frozen=True)
class DataRecipe:
    """How the data is made: "answers" (the target's own) or "text" (the corpus's, relabelled)."""
    source: str = "answers"
    max_prompt: int = 192             # prompt tokens (longer prompts are skipped)
    max_answer: int = 384             # answer tokens (the target's, or the corpus's cut there)
    shard_seqs: int = 64              # sequences a shard; also the engine's batch

    def check(self) -> "DataRecipe":
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        for name in ("max_prompt", "max_answer", "shard_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        return self


def _items(tokenizer, exchanges, recipe: DataRecipe):
    """(prompt ids, answer ids or None) of the usable exchanges, in corpus order."""
    for ex in exchanges:
        p = encode_chat(tokenizer, ex.prompt)
        if len(p) > recipe.max_prompt:
            continue
        a = None
        if recipe.source == "text":
            a = tokenizer(ex.answer, add_special_tokens=False)["input_ids"][:recipe.max_answer]
        yield p, a


def data_folder(model, recipe: DataRecipe, exchanges: list[Exchange]):
    h = hashlib.sha256(json.dumps([FORMAT, asdict(recipe)]).encode())
    for ex in exchanges:
        h.update(json.dumps([ex.prompt, ex.answer]).encode())
    return cache_dir() / "drafting-data" / f"{weights_fingerprint(model)[:16]}-{h.hexdigest()[:16]}"


def save_shard(path, samples: list[Sample], key: str, index: int) -> None:
    lab = [s.labels if s.labels is not None else torch.full_like(s.ids, -1) for s in samples]
    blob = {"format": FORMAT, "key": key, "index": index,
            "ids": torch.cat([s.ids for s in samples]).int(),                # (N,)
            "labels": torch.cat(lab).int(),                                  # (N,)
            "hidden": torch.cat([s.hidden.to(torch.float16) for s in samples]),   # (N, C)
            "lengths": torch.tensor([s.ids.numel() for s in samples]),
            "starts": torch.tensor([s.start for s in samples])}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_shard(path, key: str, index: int, width: int, dtype=torch.float16) -> list[Sample]:
    """The shard's Samples; ValueError when it does not load or is not this build's."""
    try:
        blob = torch.load(path, weights_only=True, mmap=True)
        ok = (isinstance(blob, dict) and blob.get("format") == FORMAT and blob.get("key") == key
              and blob.get("index") == index)
        n = blob["ids"].numel() if ok else 0
        ok = ok and blob["hidden"].shape == (n, width) and blob["labels"].numel() == n \
            and int(blob["lengths"].sum()) == n and len(blob["starts"]) == len(blob["lengths"])
    except Exception as err:                     # unpickling garbage raises many kinds
        raise ValueError(f"data shard {path} does not load ({type(err).__name__})") from None
    if not ok:
        raise ValueError(f"data shard {path} belongs to another build or is damaged")
    out, at = [], 0
    for L, st in zip(blob["lengths"].tolist(), blob["starts"].tolist()):
        lab = blob["labels"][at:at + L].long()
        out.append(Sample(blob["ids"][at:at + L].long(), blob["hidden"][at:at + L].to(dtype), st,
                          None if bool((lab < 0).all()) else lab))
        at += L
    return out


def answer_tokens(samples: list[Sample]) -> int:
    return sum(s.ids.numel() - s.start for s in samples)


def _valid(path, key, index, width):
    if not path.is_file():
        return None
    try:
        return load_shard(path, key, index, width)
    except ValueError as err:
        warnings.warn(f"{err}; building it again")
        return None


def _shards(tokenizer, exchanges, recipe):
    """Shard k's items (prompt ids, answer ids or None), k = 0, 1, ..., made lazily."""
    items, shard = _items(tokenizer, exchanges, recipe), []
    for item in items:
        shard.append(item)
        if len(shard) == recipe.shard_seqs:
            yield shard
            shard = []
    if shard:
        yield shard


def _make(model, tokenizer, recipe, shards: list[list], max_num_seqs: int):
    """Yields (j, samples) as shard j of `shards` completes."""
    if recipe.source == "text":
        for j, shard in enumerate(shards):
            yield j, teacher_force(model, [(p + a, len(p)) for p, a in shard],
                                   pad_id=tokenizer.pad_token_id or 0)
        return
    prompts = [p for shard in shards for p, _ in shard]
    owner = [(j, r) for j, shard in enumerate(shards) for r in range(len(shard))]
    got = [dict() for _ in shards]
    for i, sample in answer_with_features(model, prompts, recipe.max_answer,
                                          [tokenizer.eos_token_id], max_num_seqs):
        j, r = owner[i]
        got[j][r] = sample
        if len(got[j]) == len(shards[j]):
            yield j, [got[j][r] for r in range(len(shards[j]))]


def build_data(model, tokenizer, tokens: int = 200_000, recipe: DataRecipe = DataRecipe(),
               exchanges=None, max_num_seqs: int | None = None, window: int = 4,
               progress: bool = True) -> dict:
    """Shards holding at least `tokens` answer tokens (or the whole corpus), made or found.
    `exchanges`: `Exchange`s to use instead of the packaged corpus (tests). Returns a summary."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    recipe = recipe.check()
    exchanges = list(sharegpt_exchanges() if exchanges is None else exchanges)
    folder = data_folder(model, recipe, exchanges)
    folder.mkdir(parents=True, exist_ok=True)
    key, width = folder.name, model.config.d_model
    max_num_seqs = max_num_seqs or recipe.shard_seqs
    bar = tqdm(total=tokens, unit="tok", desc="drafter data (answer tokens)", disable=not progress)
    stats = {"folder": str(folder), "shards": 0, "built": 0, "sequences": 0, "tokens": 0,
             "answer_tokens": 0}

    def count(samples, built):
        stats["shards"] += 1
        stats["built"] += built
        stats["sequences"] += len(samples)
        stats["tokens"] += sum(s.ids.numel() for s in samples)
        stats["answer_tokens"] += answer_tokens(samples)
        bar.update(min(answer_tokens(samples), tokens - bar.n))

    source = enumerate(_shards(tokenizer, exchanges, recipe))
    while stats["answer_tokens"] < tokens:
        per = stats["answer_tokens"] / max(stats["shards"], 1) or None   # tokens a shard, so far
        left = tokens - stats["answer_tokens"]
        size = window if per is None else max(1, min(window, int(-(-left // per))))
        group = []                       # missing shards, answered together (the engine stays full)
        for k, shard in source:
            found = _valid(folder / f"shard-{k:05d}.pt", key, k, width)
            if found is not None:
                count(found, 0)
                if stats["answer_tokens"] >= tokens:
                    break
                continue
            group.append((k, shard))
            if len(group) == size:
                break
        if not group or stats["answer_tokens"] >= tokens:
            break
        for j, samples in _make(model, tokenizer, recipe, [s for _, s in group], max_num_seqs):
            save_shard(folder / f"shard-{group[j][0]:05d}.pt", samples, key, group[j][0])
            count(samples, 1)
    bar.close()
    return stats


def load_data(model, tokenizer=None, recipe: DataRecipe = DataRecipe(), exchanges=None,
              tokens: int | None = None, dtype=torch.float32) -> list[Sample]:
    """The Samples `build_data` stored for this target and recipe, shard by shard from the
    first, until `tokens` answer tokens (None: every shard there); a bad shard is reported and
    skipped, and a missing one ends the list. Features in `dtype`."""
    recipe = recipe.check()
    exchanges = list(sharegpt_exchanges() if exchanges is None else exchanges)
    folder = data_folder(model, recipe, exchanges)
    out, k = [], 0
    while (folder / f"shard-{k:05d}.pt").is_file() and (tokens is None or answer_tokens(out) < tokens):
        found = _valid(folder / f"shard-{k:05d}.pt", folder.name, k, model.config.d_model)
        out += [Sample(s.ids, s.hidden.to(dtype), s.start, s.labels) for s in found or []]
        k += 1
    return out
