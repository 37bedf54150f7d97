"""The engine with the real trained-drafter proposers (seeded random `MedusaHeads`, `EagleDrafter`,
and `LookaheadProposer`), against plain greedy decoding, over prefix caching, chunked prefill and
both preemption modes; heads given as objects or files, and the files' errors (heads made for
another model, a corrupt file) refused before the engine is built."""
import pytest
import torch

from engine_configs import CONFIGS
from minillm import EagleDrafter, MedusaHeads, generate, tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.sampling_params import SamplingParams
from tree_drafters import model, work  # noqa: F401 (shared fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = {"chunk8": CONFIGS["bs3_chunk8"], "prefix_cache_swap": CONFIGS["prefix_cache_swap"],
            "preempt_recompute": dict(block_size=2, num_blocks=28, max_num_seqs=64,
                                      max_num_batched_tokens=64)}


def drafter_for(model, method):
    if method == "medusa":
        return MedusaHeads(model.config, num_heads=3, seed=0).to(torch.float64)
    if method == "eagle":
        return EagleDrafter(model.config, seed=0).to(torch.float64)
    return None


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("method", ["medusa", "eagle", "lookahead"])
def test_real_proposers_greedy_equals_plain(model, work, method, name):
    prompts, max_tokens, refs = work
    engine = LLMEngine(model, EngineConfig(**SETTINGS[name]), speculative_config={
        "method": method, "num_speculative_tokens": 3, "model": drafter_for(model, method)})
    outs = engine.generate(prompts, [SamplingParams(max_tokens=k) for k in max_tokens])
    assert [o.token_ids for o in outs] == refs
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.num_free_blocks == engine.num_blocks


def test_heads_from_a_file_and_the_files_errors(model, work, tmp_path):
    prompts, max_tokens, refs = work
    heads = drafter_for(model, "medusa")
    heads.save(tmp_path / "medusa.pt", model)
    engine = LLMEngine(model, EngineConfig(num_blocks=200), speculative_config={
        "method": "medusa", "num_speculative_tokens": 3, "model": str(tmp_path / "medusa.pt")})
    outs = engine.generate(prompts[:3], [SamplingParams(max_tokens=k) for k in max_tokens[:3]])
    assert [o.token_ids for o in outs] == refs[:3]
    other = tiny_model(vocab_size=256, seed=1, dtype=torch.float64)
    (tmp_path / "corrupt.pt").write_bytes(b"not a torch file")
    for path, match in ((tmp_path / "medusa.pt", "other weights"), (tmp_path / "corrupt.pt", "corrupt")):
        with pytest.raises(ValueError, match=match):
            LLMEngine(other, EngineConfig(num_blocks=16), speculative_config={
                "method": "medusa", "num_speculative_tokens": 3, "model": str(path)})
    with pytest.raises(ValueError, match="num_heads=3"):
        LLMEngine(model, EngineConfig(num_blocks=16), speculative_config={
            "method": "medusa", "num_speculative_tokens": 4, "model": heads})
    with pytest.raises(TypeError, match="must be a MedusaHeads"):
        LLMEngine(model, EngineConfig(num_blocks=16), speculative_config={
            "method": "medusa", "num_speculative_tokens": 3, "model": drafter_for(model, "eagle")})


def test_llm_trains_heads_for_none_and_checks_the_dict_first(monkeypatch, tok):
    """LLM(speculative_config={"model": None}) asks `train_medusa(model, tokenizer)` for the
    heads (a stand-in here: the real training is chapter 10's, tested there); a bad dict is
    refused before any training."""
    from minillm import LLM
    from minillm import llm as front_door
    tiny = tiny_model(vocab_size=len(tok), seed=0, dtype=torch.float64)
    calls = []

    def fake_train(model, tokenizer, num_heads=4, **kw):
        calls.append((model, tokenizer, num_heads))
        return MedusaHeads(model.config, num_heads=num_heads, seed=0).to(torch.float64)
    monkeypatch.setattr(front_door, "train_medusa", fake_train)
    with pytest.raises(ValueError, match="prefix-closed"):
        LLM(tiny, tok, num_blocks=64, speculative_config={
            "method": "medusa", "num_speculative_tokens": 3, "model": None,
            "speculative_token_tree": [(0,), (1, 0)]})
    assert calls == []
    llm = LLM(tiny, tok, num_blocks=64, speculative_config={
        "method": "medusa", "num_speculative_tokens": 5, "model": None})
    assert calls == [(tiny, tok, 5)]
    prompt = tok.encode("Once upon a time")
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == generate(tiny, prompt, 10)


@pytest.mark.parametrize("method", ["medusa", "eagle", "lookahead"])
def test_sampling_runs_and_a_seeded_request_repeats(model, work, method):
    """At temperature 0.8 the deterministic drafts go through the exact rule: every request
    finishes with its max_tokens, and a seeded request gives the same tokens on a fresh engine."""
    prompts, max_tokens, _ = work
    params = [SamplingParams(temperature=0.8, max_tokens=k, seed=i) for i, k in enumerate(max_tokens)]
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, EngineConfig(**SETTINGS["prefix_cache_swap"]), speculative_config={
            "method": method, "num_speculative_tokens": 3, "model": drafter_for(model, method)})
        runs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == max_tokens


def test_serve_json_lookahead_answers_as_plain_decoding(tok):
    """The dict a server parses from --speculative-config (JSON: no objects) serves exactly."""
    import json

    import httpx
    from minillm.serve import running
    from serve_tiny import MODEL, completion, tiny_llm
    spec = json.loads('{"method": "lookahead", "num_speculative_tokens": 3}')
    body = completion("Once upon a time", max_tokens=12, ignore_eos=True)
    want = tiny_llm(tok).generate(["Once upon a time"], SamplingParams(max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
    llm = tiny_llm(tok, speculative_config=spec)
    with running(llm, served_model_name=MODEL) as srv:
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
