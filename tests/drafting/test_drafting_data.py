"""Drafter data at scale (chapter 10, `drafting/corpus.py`, `capture.py`, `data.py`), on a tiny
model with SmolLM2's tokenizer and a few made-up exchanges. References: `json.loads` of the
complete part of a cut-off array, plain greedy `generate` and one dense forward pass of the
target (its hidden rows and its argmax labels). Resuming builds nothing twice; a damaged or
foreign shard is reported in one warning and built again, equal to the first build."""
import io
import json

import pytest
import torch

import minillm
from minillm.drafting.__main__ import main
from minillm.drafting.corpus import Exchange, first_exchanges, json_array_items
from minillm.drafting.data import DataRecipe, build_data, data_folder, load_data
from minillm.drafting.prompts import EVAL_CHAT_PROMPTS
from minillm.model.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")   # fixture in conftest.py
EX = [Exchange(f"Tell me something about the number {i}, please.", f"Here is a fact {i}. " * 20)
      for i in range(7)]
ANSWERS = DataRecipe(max_answer=10, shard_seqs=3)
TEXT = DataRecipe(source="text", max_answer=10, shard_seqs=3)


def test_json_items_stop_at_the_cut_and_match_json_loads():
    items = [{"id": i, "conversations": [{"from": "human", "value": "x" * (i * 37 % 90)}]}
             for i in range(40)]
    text = json.dumps(items, indent=1)
    for cut in (len(text), len(text) - 1, len(text) // 2, 3):
        whole = text[:cut]
        done = whole.rfind("\n }") + 3 if cut < len(text) else len(text)   # the last whole item
        ref = json.loads(whole[:done] + ("]" if cut < len(text) else ""))
        assert list(json_array_items(io.StringIO(whole), chunk_chars=64)) == ref
    with pytest.raises(ValueError, match="JSON array"):
        list(json_array_items(io.StringIO('{"a": 1}')))


def test_first_exchanges_filter():
    def conv(u, g, first="human"):
        return {"conversations": [{"from": first, "value": u}, {"from": "gpt", "value": g}]}
    long = "An answer that is long enough. " * 10
    items = [conv("Fine question?", long), conv("Fine question?", "too short"),
             conv("q" * 701, long), conv("Fine?", long, first="gpt"), conv("Ünïcödé " * 20, long),
             conv(EVAL_CHAT_PROMPTS[0], long), {"conversations": []}, "junk"]
    assert list(first_exchanges(items)) == [Exchange("Fine question?", long.strip())]


@pytest.fixture(scope="module")
def tiny(tok):
    return minillm.tiny_model(vocab_size=len(tok), seed=0)


def test_answers_are_plain_greedy_with_the_dense_forwards_features(tiny, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    s = build_data(tiny, tok, 10**6, ANSWERS, exchanges=EX, max_num_seqs=2, progress=False)
    assert (s["shards"], s["built"], s["sequences"]) == (3, 3, 7)       # the whole corpus
    data = load_data(tiny, tok, ANSWERS, exchanges=EX)
    assert len(data) == 7 and s["answer_tokens"] == sum(d.ids.numel() - d.start for d in data)
    for d in data:
        prompt = d.ids[:d.start].tolist()
        ref = generate(tiny, prompt, 10, stop_token_ids=[tok.eos_token_id])
        assert d.ids[d.start:].tolist() == ref[:-1] and d.labels is None   # the last one dropped
        with torch.inference_mode():
            _, h = tiny(d.ids[None], return_hidden=True)
        torch.testing.assert_close(d.hidden, h[0], atol=3e-3, rtol=3e-3)   # fp16 storage


def test_text_labels_are_the_targets_argmax(tiny, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    build_data(tiny, tok, 10**6, TEXT, exchanges=EX, progress=False)
    data = load_data(tiny, tok, TEXT, exchanges=EX)
    for d, ex in zip(data, EX):
        assert d.ids.numel() - d.start == 10
        assert tok.decode(d.ids[d.start:]).strip() in ex.answer
        with torch.inference_mode():
            logits, h = tiny(d.ids[None], return_hidden=True)
        assert d.labels[0] == d.ids[0] and torch.equal(d.labels[1:], logits[0, :-1].argmax(-1))
        torch.testing.assert_close(d.hidden, h[0], atol=3e-3, rtol=3e-3)


def test_resume_and_bad_shards_are_rebuilt(tiny, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    first = build_data(tiny, tok, 1, ANSWERS, exchanges=EX, window=1, progress=False)
    assert (first["shards"], first["built"]) == (1, 1)                  # stops at the token count
    folder = data_folder(tiny, ANSWERS, EX)
    shard0 = (folder / "shard-00000.pt").read_bytes()
    (folder / "shard-00001.pt.tmp").write_bytes(b"half a shard")         # an interrupted write
    more = build_data(tiny, tok, 10**6, ANSWERS, exchanges=EX, progress=False)
    assert (more["shards"], more["built"]) == (3, 2)                    # resumed, nothing twice
    assert (folder / "shard-00000.pt").read_bytes() == shard0
    ref = load_data(tiny, tok, ANSWERS, exchanges=EX)
    (folder / "shard-00000.pt").write_bytes(b"not a shard")              # corrupt
    (folder / "shard-00001.pt").write_bytes((folder / "shard-00002.pt").read_bytes())   # foreign
    with pytest.warns(UserWarning) as caught:
        again = build_data(tiny, tok, 10**6, ANSWERS, exchanges=EX, progress=False)
    lines = [str(w.message) for w in caught]
    assert len(lines) == 2 and "does not load" in lines[0] and "another build" in lines[1]
    assert all("\n" not in x for x in lines) and again["built"] == 2
    got = load_data(tiny, tok, ANSWERS, exchanges=EX)
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.hidden, b.hidden) for a, b in zip(got, ref))


def test_bad_input(tiny, tok):
    with pytest.raises(ValueError, match="tokens"):
        build_data(tiny, tok, 0, ANSWERS, exchanges=EX)
    with pytest.raises(ValueError, match="source"):
        build_data(tiny, tok, 10, DataRecipe(source="web"), exchanges=EX)
    with pytest.raises(ValueError, match="shard_seqs"):
        DataRecipe(shard_seqs=0).check()
    for argv in (["build-data", "--tokens", "0"], ["build-data", "--batch", "0"], ["nothing"]):
        with pytest.raises(SystemExit):
            main(argv)


def test_data_recipe_trains_on_the_shards_with_a_held_out_curve(tiny, tok, tmp_path, monkeypatch):
    """Recipe(source="data") reads what build_data stored (ids as the targets, inputs normalized)
    and scores held-out samples as it trains: the last point equals `sample_accuracy` of the
    drafter it returns. No data: a ValueError saying how to build it."""
    import minillm.drafting.train as train
    from minillm.drafting.evaluate import sample_accuracy
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    build_data(tiny, tok, 10**6, ANSWERS, exchanges=EX, max_num_seqs=2, progress=False)
    monkeypatch.setattr(train, "load_data", lambda m, t, tokens=None: load_data(
        m, t, ANSWERS, exchanges=EX, tokens=tokens))
    r = train.Recipe(source="data", steps=6, batch_rows=16, eagle_chunk=8, norm_inputs=True)
    held = load_data(tiny, tok, ANSWERS, exchanges=EX)[:2]
    d = train.train_eagle(tiny, tok, r, held_out=held, eval_every=3, draft_vocab_size=40,
                          cache=False, progress=False)
    assert d.norm_inputs and d.draft_vocab.numel() == 40
    assert [c["step"] for c in d.meta["curve"]] == [0, 3, 6]
    final = sample_accuracy(tiny, d, held, depth=2)
    assert d.meta["curve"][-1]["top1"] == [round(x, 4) for x in final["top1"]]
    heads = train.train_medusa(tiny, tok, 2, r, draft_vocab_size=40, cache=False, progress=False)
    assert heads.meta["recipe"]["source"] == "data"
    monkeypatch.setattr(train, "load_data", lambda m, t, tokens=None: [])
    with pytest.raises(ValueError, match="build-data"):
        train.train_eagle(tiny, tok, r, cache=False, progress=False)
    with pytest.raises(ValueError, match="eval_every"):
        train.train_eagle(tiny, tok, r, held_out=held, eval_every=0, cache=False)
    with pytest.raises(ValueError, match="recipe.source"):
        train.train_eagle(tiny, tok, train.Recipe(source="web"), cache=False)


def test_recipes_made_before_the_data_fields_keep_their_cache_files():
    """Fields added to Recipe stay out of the key at their defaults: the keys below were
    computed by the training code before those fields existed."""
    from minillm.drafting.train import DRAFT_VOCAB, RECIPES, _key, _recipe_key
    old = {("small", "eagle", None): "a3c367d93ff9620e", ("small", "medusa", 4): "26a723b6977941ab",
           ("full", "eagle", None): "d57517df6ba92ac3", ("full", "medusa", 4): "955d96bcb26e0e6a"}
    for (name, kind, extra), key in old.items():
        assert _key([kind, _recipe_key(RECIPES[name]), extra, 0, DRAFT_VOCAB]) == key
    assert _recipe_key(RECIPES["data"])["source"] == "data"
