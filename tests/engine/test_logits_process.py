"""The logits processors (engine/logits_process.py) against transformers' own processors on the
real model's logits, presence/frequency against OpenAI's formula written out here, the grammar
hook with a fake grammar, and row j of a speculative verify against processing with drafts[:j]
really appended.

References: `RepetitionPenaltyLogitsProcessor`, `SequenceBiasLogitsProcessor`,
`MinNewTokensLengthLogitsProcessor`, `NoBadWordsLogitsProcessor`, `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper` from transformers; the rest by hand.
"""
import pytest
import torch
from transformers.generation import logits_process as hf

from minillm import tiny_model
from minillm.engine.llm_engine import EngineConfig, LLMEngine
from minillm.engine.logits_process import LogitsProcessors, process_logits, token_counts
from minillm.engine.sampling_params import SamplingParams
from minillm.engine.sequence import Sequence
from minillm.engine.structured import StructuredOutputsParams
from minillm.model.sampling import logits_to_probs

PROMPT = "The capital of France is Paris. The capital of Italy is"
OUTPUT = " Rome. Rome is a city, a city of Rome and Paris is a city"


@pytest.fixture(scope="module")
def real(smollm2):
    """(model, tokenizer, prompt ids, output ids, logits (V,) after prompt + output)."""
    model, tok = smollm2
    prompt, output = tok.encode(PROMPT), tok.encode(OUTPUT)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output]))[0, -1]                      # (V,)
    return model, tok, prompt, output, logits


def make_seq(params, prompt, output, tokenizer=None, V=None, eos=None, grammar=None) -> Sequence:
    seq = Sequence(0, "r", list(prompt), params, 0.0)
    seq.output_token_ids = list(output)
    seq.procs = LogitsProcessors.build(params, V, tokenizer, eos)
    seq.grammar = grammar
    return seq


def ours(real, params, output=None, eos=None):
    model, tok, prompt, out, logits = real
    seq = make_seq(params, prompt, out if output is None else output, tok,
                   model.config.vocab_size, eos)
    return process_logits(logits[None], seq)[0]


@pytest.mark.slow
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(real, penalty):
    """Over prompt + output; the logits shifted so that seen tokens have both signs."""
    model, tok, prompt, output, logits = real
    logits = logits - logits[prompt + output].median()
    seen = torch.tensor(prompt + output)
    assert (logits[seen] > 0).any() and (logits[seen] < 0).any()
    ref = hf.RepetitionPenaltyLogitsProcessor(penalty)(seen[None], logits[None].clone())[0]
    params = SamplingParams(repetition_penalty=penalty)
    seq = make_seq(params, prompt, output, tok, model.config.vocab_size)
    got = process_logits(logits[None], seq)[0]
    assert torch.allclose(got, ref, atol=1e-6)
    assert not torch.equal(got, logits)                 # it did something


@pytest.mark.slow
@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.8), (-1.0, 1.5), (2.0, -2.0)])
def test_presence_and_frequency_match_the_formula(real, presence, frequency):
    """OpenAI's formula over the output tokens only (the prompt does not count)."""
    _, _, prompt, output, logits = real
    ref = logits.clone()
    for t in set(output):
        ref[t] -= presence + frequency * output.count(t)
    got = ours(real, SamplingParams(presence_penalty=presence, frequency_penalty=frequency))
    assert torch.allclose(got, ref, atol=1e-5)
    assert any(output.count(t) > 1 for t in output)     # a repeated token makes frequency count


@pytest.mark.slow
def test_logit_bias_matches_transformers(real):
    _, _, prompt, output, logits = real
    bias = {output[0]: -100.0, 17: 5.5, 4000: -0.25}
    ref = hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(ours(real, SamplingParams(logit_bias=bias)), ref, atol=1e-5)


@pytest.mark.slow
def test_min_tokens_matches_transformers(real):
    """EOS and stop_token_ids are banned while fewer than min_tokens tokens are out, then free."""
    _, tok, prompt, output, logits = real
    eos, stops, m = tok.eos_token_id, [13, 30], 6
    proc = hf.MinNewTokensLengthLogitsProcessor(len(prompt), m, [eos] + stops)
    params = SamplingParams(min_tokens=m, max_tokens=16, stop_token_ids=stops)
    for k in range(m + 2):
        ref = proc(torch.tensor([prompt + output[:k]]), logits[None].clone())[0]
        got = ours(real, params, output=output[:k], eos=eos)
        assert torch.equal(got, ref), k
        assert (got[eos] == float("-inf")) == (k < m)
    # ignore_eos: EOS does not stop the sequence, so it is not banned (stop_token_ids still are)
    got = ours(real, SamplingParams(min_tokens=m, max_tokens=16, stop_token_ids=stops,
                                    ignore_eos=True), output=[], eos=eos)
    assert got[eos] == logits[eos] and (got[stops] == float("-inf")).all()


def words_by_hand(tok, word):
    """vLLM's rule: the word alone, and after a space if that gives another first token of the
    same length."""
    plain = tok.encode(word, add_special_tokens=False)
    spaced = tok.encode(" " + word, add_special_tokens=False)
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


@pytest.mark.slow
def test_bad_words_match_transformers(real):
    """Each word's last token is banned exactly when the output ends with its other tokens
    (transformers' processor, given the output as its context: vLLM looks at the output only)."""
    model, tok, prompt, output, logits = real
    words = ["Paris Hilton", "city", "hello world"]
    ids = [w for word in words for w in words_by_hand(tok, word)]
    seq = make_seq(SamplingParams(bad_words=words), prompt, [], tok, model.config.vocab_size)
    assert sorted(map(list, seq.procs.bad_words)) == sorted(ids)
    assert any(len(w) > 1 for w in ids) and any(len(w) == 1 for w in ids)
    ref_proc = hf.NoBadWordsLogitsProcessor(ids)
    two = next(w for w in ids if len(w) > 1)
    for tail in ([], output, output + two[:-1], two[:-1]):     # the last two end with a prefix
        got = ours(real, SamplingParams(bad_words=words), output=tail)
        ctx = torch.tensor([tail or [0]])                      # transformers needs one token
        ref = ref_proc(ctx, logits[None].clone())[0]
        assert torch.equal(got, ref), tail
    assert ours(real, SamplingParams(bad_words=words), output=two[:-1])[two[-1]] == float("-inf")


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, -1, 1.0, 0.0), (1.0, 40, 1.0, 0.0), (0.9, -1, 0.8, 0.0), (1.3, 50, 0.9, 0.0),
    (1.0, -1, 1.0, 0.05), (0.6, -1, 1.0, 0.2), (1.2, 30, 1.0, 0.1)])
def test_temperature_topk_topp_minp_match_transformers(real, temperature, top_k, top_p, min_p):
    """logits_to_probs against transformers' warpers: temperature, top-k, top-p, min-p (min-p
    commutes with top-k; with top-p the two libraries' orders differ, so they are not mixed)."""
    logits = real[-1][None].clone()
    ref = hf.TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        ref = hf.TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = hf.TopPLogitsWarper(top_p)(None, ref)
    if min_p > 0:
        ref = hf.MinPLogitsWarper(min_p)(None, ref)
    ref = torch.softmax(ref, -1)
    got = logits_to_probs(logits, temperature, top_k, top_p, min_p=min_p)
    assert torch.equal(got > 0, ref > 0)
    assert torch.allclose(got, ref, atol=1e-6)
    assert (ref == 0).any() == (top_k > 0 or top_p < 1 or min_p > 0)


class FakeGrammar:
    """A stand-in GrammarState: after a history h, the allowed tokens are {sum(h) % 5 + j : j < 3}
    (so the mask depends on every token before it); done after `length` tokens."""

    def __init__(self, V, history=(), length=4):
        self.V, self.history, self.length = V, list(history), length

    def row(self, h):
        m = torch.zeros(self.V, dtype=torch.bool)
        m[[(sum(h) % 5) + j for j in range(3)]] = True
        return m

    def allowed(self, drafts=()):
        return torch.stack([self.row(self.history + list(drafts[:j])) for j in range(len(drafts) + 1)])

    def accept(self, ids):
        assert all(self.row(self.history + list(ids[:i]))[t] for i, t in enumerate(ids)), "refused"
        self.history += list(ids)

    def fork(self):
        return FakeGrammar(self.V, self.history, self.length)

    @property
    def done(self):
        return len(self.history) >= self.length


def test_grammar_mask():
    V = 16
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    g = FakeGrammar(V, history=[2])
    seq = make_seq(SamplingParams(), [1], [2], V=V, grammar=g)
    got = process_logits(logits, seq)[0]
    allowed = g.row([2])
    assert torch.equal(got[allowed], logits[0, allowed])
    assert (got[~allowed] == float("-inf")).all()


ALL = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.4,
                     logit_bias={3: 1.0, 5: -2.0}, min_tokens=5, max_tokens=20,
                     stop_token_ids=[7], bad_words=["x"])


class ToyTokenizer:
    """Encodes "x" as [4, 6] and " x" as [8, 6]: a two-token bad word, in both spellings."""

    def encode(self, text, add_special_tokens=False):
        return [8, 6] if text.startswith(" ") else [4, 6]


@pytest.mark.parametrize("with_grammar", [False, True])
def test_verify_row_j_sees_drafts_before_it(with_grammar):
    """Processing K + 1 rows with drafts equals processing row j alone after the drafts[:j] are
    really appended, for every processor at once (penalties, bias, min_tokens, bad words,
    grammar). The drafts repeat tokens and complete the bad word's prefix, so a row that
    ignored drafts[:j] would differ."""
    V, K = 16, 4
    logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    output, drafts = [3, 4], [4, 3, 3, 2]                 # row 1 follows ...4 then 4: bad word 4,6
    gram = FakeGrammar(V, history=output, length=99) if with_grammar else None
    seq = make_seq(ALL, [9, 9, 1], output, ToyTokenizer(), V, eos=2, grammar=gram)
    assert seq.procs.bad_words == ((4, 6), (8, 6))
    rows = process_logits(logits, seq, drafts)                                  # (K+1, V)
    for j in range(K + 1):
        g = FakeGrammar(V, output + drafts[:j], 99) if with_grammar else None
        alone = make_seq(ALL, [9, 9, 1], output + drafts[:j], ToyTokenizer(), V, eos=2, grammar=g)
        assert torch.equal(rows[j], process_logits(logits[j:j + 1], alone)[0]), j
    # and the drafts did matter: min_tokens lifts at row 3, the bad word bites at row 1, the
    # grammar's rows differ
    if with_grammar:
        assert len({tuple(torch.isinf(r).tolist()) for r in rows}) > 1
    else:
        assert rows[2, 7] == float("-inf") and rows[3, 7] > float("-inf")
        assert rows[1, 6] == float("-inf") and rows[2, 6] > float("-inf")
    assert token_counts(output, drafts, V, "cpu")[4, 3].item() == 3


def test_no_processing_leaves_requests_alone():
    """A request that asks for nothing gets no processors (and so no extra work)."""
    assert LogitsProcessors.build(SamplingParams(temperature=0.5, top_k=3, min_tokens=0), 64) is None
    assert LogitsProcessors.build(SamplingParams(min_tokens=2, max_tokens=4), 64, eos_token_id=1)


def test_bad_input_names_the_field():
    model = tiny_model(vocab_size=32, seed=0)
    engine = LLMEngine(model, EngineConfig(num_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={32: 1.0}))
    with pytest.raises(TypeError, match="bad_words"):
        engine.add_request([1, 2], SamplingParams(bad_words=["no"]))
    with pytest.raises(TypeError, match="structured_outputs"):
        engine.add_request([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="[a-z]+")))
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        logits_to_probs(torch.zeros(3), min_p=-0.1)
    with pytest.raises(ValueError, match="best_of"):
        engine.add_request([1, 2], SamplingParams(n=2, best_of=40))
    assert not engine.requests and engine.num_free_blocks == engine.num_blocks
    engine.add_request([1, 2], SamplingParams(logit_bias={31: 1.0}, max_tokens=2))   # fine


@pytest.mark.slow
def test_min_tokens_holds_stop_strings_back(real):
    """vLLM's rule: a stop string counts only in text that comes after the first min_tokens
    tokens. "1, 2, 3, 4," goes on " 5, 6, 7, ...": stop="," ends it at once without min_tokens."""
    model, tok, *_ = real
    engine = LLMEngine(model, EngineConfig(num_blocks=64), tokenizer=tok)
    free, first, held = engine.generate(["1, 2, 3, 4,"] * 3, [
        SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, stop=[","]),
        SamplingParams(max_tokens=12, stop=[","], min_tokens=4)])
    assert free.text.startswith(" 5, 6, 7,")
    assert first.text == " 5" and first.finish_reason == "stop"
    # tokens " ", "5", ",", " " are the first 4: their comma stays; the next comma stops it
    assert held.text == " 5, 6" and held.finish_reason == "stop" and len(held.token_ids) > 4


class ToyTextTokenizer:
    """Enough of a tokenizer for the engine: one letter per token, EOS = 31."""

    eos_token_id = 31

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 32 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("spec", [False, True])
def test_engine_grammar_hook(monkeypatch, spec):
    """The engine starts a grammar per request, masks every row with it, advances it with the
    tokens it appends (FakeGrammar.accept fails on a refused token), forks it for n > 1, and
    stops a sequence when it is done; greedy output is the same with n-gram speculation."""
    import minillm.engine.requests as engine_requests
    V, started = 32, []

    class StartingFake(FakeGrammar):
        @classmethod
        def start(cls, params, tokenizer, vocab_size):
            started.append(params)
            return cls(vocab_size, length=6)

    monkeypatch.setattr(engine_requests, "GrammarState", StartingFake)
    model = tiny_model(vocab_size=V, seed=0, dtype=torch.float64)
    cfg = dict(num_speculative_tokens=3, speculative_method="ngram") if spec else {}
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8,
                                           **cfg), tokenizer=ToyTextTokenizer())
    so = StructuredOutputsParams(regex="[a-c]+")
    outs = engine.generate([[1, 2, 3, 1, 2, 3], [4, 5, 6]], [
        SamplingParams(max_tokens=20, structured_outputs=so, n=2, temperature=1.0, seed=1),
        SamplingParams(max_tokens=20, structured_outputs=so, frequency_penalty=-1.0)])
    assert started == [so, so]
    for out in outs:
        for c in out.outputs:
            g = FakeGrammar(V, length=6)
            g.accept(c.token_ids)                    # every token was allowed after those before it
            assert len(c.token_ids) == 6 and c.finish_reason == "stop"
    if spec:
        assert engine.spec_stats.num_accepted_tokens > 0
        plain = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8),
                          tokenizer=ToyTextTokenizer())
        assert plain.generate([[4, 5, 6]], SamplingParams(
            max_tokens=20, structured_outputs=so, frequency_penalty=-1.0))[0].token_ids == outs[1].token_ids
    assert engine.num_free_blocks == engine.num_blocks
