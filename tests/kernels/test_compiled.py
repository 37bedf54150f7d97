"""minillm.kernels.compiled: torch.compile's step against the reference forward.

One compile session (two row counts of a 2-layer tiny model, about half a minute on a 2-core CPU)
serves every check; the trusted reference is the dense forward of the whole sequence (no cache).
Timing decides nothing here: `choice` may be either, and each is checked to run correctly.
"""
import pytest
import torch

from minillm.kernels.compiled import CompiledForward, check_rows, compile_if_faster, format_choice
from minillm.kernels.cpu_tuning import accelerate
from minillm.model.loading import tiny_model

CONTEXT = 12
ATOL = 1e-4          # fp32 logits of order 1: the fused ops round differently, no more


@pytest.fixture(scope="module")
def measured(one_thread):
    model = tiny_model(vocab_size=128)
    accelerate(model, route="F.linear")           # eager as the front door runs it: the flat loop
    return model, compile_if_faster(model, rows=(1, 4), context=CONTEXT, rounds=2, steps=1)


@torch.inference_mode()
def test_compiled_steps_match_the_dense_reference(measured):
    model, choice = measured
    assert [t.rows for t in choice.timings] == [1, 4]
    assert all(t.tokens_equal and t.max_abs_diff < ATOL and t.choice in ("eager", "compiled")
               and t.compile_s > 0 and t.eager_ms > 0 and t.compiled_ms > 0 for t in choice.timings)
    prompt = torch.randint(128, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    # the verify step: 4 new tokens after the cached prompt, against the dense forward of all
    new = torch.tensor([[5, 17, 3, 99]])
    dense = model(torch.cat([prompt, new], 1))[:, CONTEXT:]                 # (1, 4, V)
    got = choice.compiled(new, torch.arange(CONTEXT, CONTEXT + 4))
    torch.testing.assert_close(got, dense, atol=ATOL, rtol=0)
    # greedy decode through the compiled 1-token step (its cache writes included) and through
    # `step` (compiled or eager, as chosen) equals greedy on the dense forward
    for run in (choice.compiled, choice.step):
        seq = prompt.clone()
        for i in range(4):
            if i == 0:
                logits = model(seq)[:, -1]
            else:
                logits = run(seq[:, -1:], torch.tensor([CONTEXT + i - 1]))[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        want = prompt.clone()
        for _ in range(4):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(seq, want)
    assert "decode step" in format_choice(choice) and "verify of 4" in format_choice(choice)
    assert set(choice.as_dict()["choice"]) == {"1", "4"}


def test_bad_input_names_the_argument():
    model = tiny_model(vocab_size=64)
    for bad in (0, [], [1, -2]):
        with pytest.raises(ValueError, match="rows"):
            compile_if_faster(model, rows=bad)
    with pytest.raises(ValueError, match="mode"):
        compile_if_faster(model, mode="fastest")
    with pytest.raises(ValueError, match="context"):
        compile_if_faster(model, context=0)
    with pytest.raises(TypeError, match="Transformer"):
        CompiledForward(torch.nn.Linear(2, 2), 8)
    assert check_rows([9, 1, 9]) == (1, 9)


def test_the_choice_keeps_compiled_only_where_it_won():
    from minillm.kernels.compiled import _pick
    assert _pick([10, 10, 10], [8, 8, 8], True, 0.03) == ("compiled", 3)
    assert _pick([10, 10, 10], [8, 8, 8], False, 0.03) == ("eager", 3)     # outputs disagree
    assert _pick([10, 10, 10], [9.9, 9.9, 9.9], True, 0.03)[0] == "eager"  # under the margin
    assert _pick([10, 10, 10, 10], [5, 5, 11, 11], True, 0.03) == ("eager", 2)   # not most rounds
