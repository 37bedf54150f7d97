"""The front door (`LLM`) and what it needs from the engine, against trusted references: greedy
text equals the tokenizer's decode of `minillm.generate`'s tokens and transformers' greedy on the
same weights; stop strings cut that reference text; chat uses `encode_chat`'s template; streamed
text never shows half a character; vLLM's speculative_config and gpu_memory_utilization map onto
the flat fields and chapter 2's planner. Tiny-model tests need no weights; the real ones share
one `LLM(model="smollm2-135m")` built once per module."""
import sys

import pytest
import torch

import minillm
from minillm import LLM, EngineConfig, LLMEngine, SamplingParams, generate, tiny_model
from minillm.model.chat import encode_chat
from minillm.engine.detokenizer import Detokenizer
from minillm.paging.sizing import num_blocks_for_memory
from minillm.analysis.kv_math import plan_capacity, weight_bytes
from minillm.paging.paged_cache import PagedKVCache

QUICKSTART = ["Hello, my name is", "The president of the United States is",
              "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab_size=256, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="smollm2-135m", num_blocks=128)


# ---- tiny model: no tokenizer, token ids only ----------------------------------------------------
def test_token_prompts_match_generate(tiny):
    llm = LLM(tiny, block_size=4, num_blocks=64)
    prompts = [[1, 2, 3], [7, 8], [9]]
    refs = [generate(tiny, p, 6) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert all(o.text is None and o.prompt is None and o.outputs[0].text is None for o in outs)
    one = llm.generate([1, 2, 3], SamplingParams(max_tokens=6), use_tqdm=False)   # one id list
    assert [o.token_ids for o in one] == refs[:1]
    dicts = llm.generate([{"prompt_token_ids": [7, 8]}], [SamplingParams(max_tokens=3)], False)
    assert dicts[0].token_ids == refs[1][:3]


def test_bad_input_names_the_argument(tiny):
    llm = LLM(tiny, num_blocks=64)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match="tokenizer"):
        llm.chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([])
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate([[1, 2], 2.5])
    with pytest.raises(ValueError, match=r"prompts\[0\].*'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "x"}])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1]], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[1]], {"max_tokens": 3})
    with pytest.raises(TypeError, match="blocksize"):
        LLM(tiny, blocksize=4)
    with pytest.raises(TypeError, match="model must be"):
        LLM(123)
    with pytest.raises(ValueError, match="dtype"):
        LLM("smollm2-135m", dtype="int8")
    with pytest.raises(ValueError, match="name_or_path"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny, block_size=0)
    with pytest.raises(ValueError, match="local folder"):
        LLM(tiny, tokenizer="no/such/folder")
    assert not llm.llm_engine.has_unfinished_requests()      # nothing half-queued


@pytest.mark.parametrize("stop, err", [(5, TypeError), (["a", 3], TypeError), ("", ValueError),
                                       (["ok", ""], ValueError)])
def test_stop_is_validated(stop, err):
    with pytest.raises(err, match="stop"):
        SamplingParams(stop=stop)


def test_stop_normalized():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=[]).stop is None


def test_stop_without_tokenizer_rejected_neighbours_served(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="stop needs .*tokenizer"):
        engine.add_request([4, 5], SamplingParams(max_tokens=5, stop=["x"]))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=5))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done == {a: generate(tiny, [1, 2, 3], 5), b: generate(tiny, [4, 5], 5)}
    assert engine.num_free_blocks == engine.num_blocks


def test_engine_generate_keywords_and_all_or_nothing(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    ref = generate(tiny, [1, 2], 4)
    sp = SamplingParams(max_tokens=4)
    assert engine.generate([[1, 2]], sampling_params=sp)[0].token_ids == ref
    assert engine.generate([[1, 2]], params=sp)[0].token_ids == ref
    assert engine.generate([[1, 2]], sp)[0].token_ids == ref
    with pytest.raises(TypeError, match="not both"):
        engine.generate([[1, 2]], sp, sampling_params=sp)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[1, 2], []], sp)
    assert not engine.has_unfinished_requests()             # the good one was not left queued


def test_abort_finished_is_a_noop(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    out = engine.generate([[1, 2]], SamplingParams(max_tokens=3))[0]
    engine.abort_request(out.request_id)                      # the client left as it completed
    assert engine.requests[out.request_id].output().finish_reason == "length"
    with pytest.raises(ValueError, match="unknown request_id"):
        engine.abort_request("never-seen")


def test_use_tqdm_shows_a_bar_and_degrades_without_tqdm(tiny, capsys, monkeypatch):
    llm = LLM(tiny, num_blocks=64)
    llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    assert "requests" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)       # `import tqdm.auto` now fails
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids == generate(tiny, [1, 2], 2)
    assert "requests" not in capsys.readouterr().err


# ---- speculative_config -------------------------------------------------------------------------
def test_speculative_config_maps_to_flat_fields(tiny):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ref = generate(tiny, prompt, 12)
    llm = LLM(tiny, num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    cfg = llm.llm_engine.config
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
            cfg.prompt_lookup_max) == ("ngram", 3, 2, 4)
    assert llm.generate(prompt, SamplingParams(max_tokens=12), False)[0].token_ids == ref
    draft = tiny_model(vocab_size=256, seed=1, dtype=torch.float64)
    llm = LLM(tiny, num_blocks=64, num_speculative_tokens=2,       # the same K flat: no conflict
              speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": draft})
    assert llm.llm_engine.config.speculative_method == "draft"
    assert llm.llm_engine.draft_model is draft
    out = llm.generate(prompt, SamplingParams(max_tokens=12), False)[0]
    assert out.token_ids == ref and out.metrics.num_spec_steps > 0


@pytest.mark.parametrize("spec, kw, match", [
    ({"method": "eagle2", "num_speculative_tokens": 2}, {}, "'ngram', 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, {}, r"unknown keys \['k'\]"),
    ({"method": "ngram"}, {}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3}, {"num_speculative_tokens": 2}, "one place"),
    ({"method": "ngram", "num_speculative_tokens": 3}, {"speculative_method": "draft"}, "one place"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, {}, "draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, {}, "draft_model"),
])
def test_speculative_config_rejects(tiny, spec, kw, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(tiny, EngineConfig(num_blocks=8, **kw), speculative_config=spec)


# ---- gpu_memory_utilization ---------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype, kv, util, act", [
    ("llama-3-8b", torch.bfloat16, "bf16", 0.9, 0.0),   # kv_math's worked example: 26,674 blocks
    ("llama-3-8b", torch.bfloat16, "bf16", 0.5, 3e9),
    ("smollm2-135m", torch.float32, "fp32", 0.3, 1.5e8),
    ("mistral-7b", torch.float16, "fp16", 1.0, 2e9),
])
def test_num_blocks_for_memory_agrees_with_plan_capacity(name, dtype, kv, util, act):
    cfg = minillm.get_config(name)
    want = plan_capacity(cfg, 80e9, util, 16, dtype=kv, activation_bytes=act).num_blocks
    assert num_blocks_for_memory(80e9, util, weight_bytes(cfg, kv), act, cfg, 16, dtype) == want
    if (name, util) == ("llama-3-8b", 0.9):
        assert want == 26_674


def test_gpu_memory_utilization_validated_and_ignored_on_cpu(tiny):
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    cfg = minillm.get_config("smollm2-135m")
    with pytest.raises(ValueError, match="no KV block"):
        num_blocks_for_memory(1e9, 0.1, 2e8, 0, cfg, 16)
    if torch.cuda.is_available():
        pytest.skip("the CPU path is what this checks")
    with pytest.warns(UserWarning, match="ignored on cpu"):
        engine = LLMEngine(tiny, EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory_bytes=2**20))
    per_block = PagedKVCache.bytes_per_block(tiny.config, 16, torch.float64)
    assert engine.num_blocks == 2**20 // per_block


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_utilization_sizes_pool_on_cuda():
    model = tiny_model(vocab_size=256, device="cuda")
    engine = LLMEngine(model, EngineConfig(gpu_memory_utilization=0.05))
    total = torch.cuda.mem_get_info()[1]
    assert engine.cache.nbytes <= 0.05 * total
    assert engine.num_blocks > 0.9 * 0.05 * total / PagedKVCache.bytes_per_block(model.config, 16)
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=4))[0].token_ids == \
        generate(model, [1, 2], 4)


# ---- the real model -----------------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_quickstart_runs(llm, capsys):
    prompts = QUICKSTART
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == prompts
    for o in outputs:
        assert o.text == o.outputs[0].text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert 1 <= len(o.token_ids) <= 16 and o.finish_reason in ("stop", "length")
    assert capsys.readouterr().out.count("Prompt: ") == 4


@pytest.mark.slow
def test_greedy_text_matches_generate_and_transformers(llm):
    from minillm.model.hf_convert import to_hf_model
    model, tok = llm.model, llm.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = to_hf_model(model)
    for p, o in zip(prompts, outs):
        ids = tok.encode(p)
        ref = generate(model, ids, 8)
        x = torch.tensor([ids])
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8,
                             do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
        assert o.token_ids == ref == theirs
        assert o.prompt_token_ids == ids and o.prompt == p
        assert o.outputs[0].text == o.text == tok.decode(ref, skip_special_tokens=True)
    by_ids = llm.generate([tok.encode(prompts[0])], SamplingParams(max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.text == outs[0].text


@pytest.mark.slow
def test_stop_strings_cut_the_reference_text(llm):
    model, tok = llm.model, llm.get_tokenizer()
    prompt = "Write a short story about a dragon."
    ref_ids = generate(model, tok.encode(prompt), 24)
    ref = tok.decode(ref_ids, skip_special_tokens=True)
    words = [w for w in ref.split() if ref.find(w) > 10]
    assert words, ref
    stop = words[0]
    cut = ref[:ref.index(stop)]
    sp = lambda **kw: SamplingParams(max_tokens=24, ignore_eos=True, **kw)   # noqa: E731
    outs = llm.generate([prompt] * 4, [sp(stop=stop), sp(stop=["zzqx#", stop]), sp(stop="zzqx#"),
                                       sp(stop=[stop], stop_token_ids=[ref_ids[1]])], use_tqdm=False)
    for o in outs[:2]:
        assert o.text == cut and o.finish_reason == "stop"
        assert o.token_ids == ref_ids[:len(o.token_ids)] and len(o.token_ids) < 24
        assert stop in tok.decode(o.token_ids, skip_special_tokens=True)   # ids keep the stop string
    assert outs[2].text == ref and outs[2].finish_reason == "length"
    first = ref_ids.index(ref_ids[1])                     # the stop token id comes first
    assert outs[3].token_ids == ref_ids[:first + 1] and outs[3].finish_reason == "stop"


@pytest.mark.slow
def test_incremental_text_never_splits_a_character(llm):
    tok = llm.get_tokenizer()
    s = "héllo 🙂 日本"
    ids = tok.encode(s)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # "日" is split over three tokens
    d = Detokenizer(tok, tok.encode("Say:"))
    seen = []
    for i in ids:
        d.append(i)
        seen.append(d.text)
    assert d.text == s
    assert all("\ufffd" not in t and s.startswith(t) for t in seen)
    assert len(set(seen)) < len(seen)                          # some steps held text back
    for stop, want in [("日", "héllo 🙂 "), ("🙂", "héllo "), ("llo 🙂", "hé"), ("本", "héllo 🙂 日")]:
        d = Detokenizer(tok, [], stop=[stop])
        for i in ids:
            d.append(i)
        assert (d.text, d.stopped) == (want, True)


@pytest.mark.slow
def test_chat_matches_encode_chat_and_minillm_chat(llm):
    model, tok = llm.model, llm.get_tokenizer()
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Answer in one word."},
              {"role": "user", "content": "What color is the sky?"}]]
    one = llm.chat(convs[0], SamplingParams(max_tokens=12), use_tqdm=False)
    both = llm.chat(convs, SamplingParams(max_tokens=12), use_tqdm=False)
    assert len(one) == 1 and len(both) == 2
    for conv, o in zip(convs, both):
        ids = encode_chat(tok, conv)
        assert o.prompt_token_ids == ids and o.prompt == tok.decode(ids)
        assert o.text == minillm.chat(model, tok, conv, max_new_tokens=12)
    assert one[0].text == both[0].text and "Paris" in one[0].text
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "user"}])


@pytest.mark.slow
def test_n_completions_each_have_their_text(llm):
    tok = llm.get_tokenizer()
    o = llm.generate("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8),
                     use_tqdm=False)[0]
    assert len(o.outputs) == 2
    for c in o.outputs:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_streamed_text_of_random_tokens(llm):
    """A random model over the real vocabulary emits byte fragments: every streamed text is a
    prefix of the final one, which equals the tokenizer's decode; a stop string cuts it."""
    tok = llm.get_tokenizer()
    noisy = tiny_model(vocab_size=len(tok), seed=0)
    engine = LLMEngine(noisy, EngineConfig(num_blocks=64), tokenizer=tok)
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    rids = [engine.add_request([10 + i, 20], sp) for i in range(3)]
    seen = {r: [] for r in rids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o.text)
    finals = {r: engine.requests[r].output() for r in rids}
    for r in rids:
        final = tok.decode(finals[r].token_ids, skip_special_tokens=True)
        assert seen[r][-1] == final and all(final.startswith(t) for t in seen[r])
    ref = tok.decode(finals[rids[0]].token_ids, skip_special_tokens=True)
    stop = next(ref[i:i + 3] for i in range(5, len(ref) - 3) if "\ufffd" not in ref[i:i + 3])
    out = engine.generate([[10, 20]], SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                                                     ignore_eos=True, stop=stop))[0]
    assert out.text == ref[:ref.index(stop)] and out.finish_reason == "stop"
