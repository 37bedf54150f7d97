"""The llama.cpp peer of the quantized decode benchmark (`benchmarks/quant_llama_cpp.py`).

The fast tests need no llama.cpp: the bytes a decode step reads from a GGUF file, checked
against a count by hand from the model's shape and the block sizes of Q4_1 and Q8_0; the skip
path when llama_cpp cannot be imported; the ratio table. With llama_cpp installed (the `compare`
extra), a slow test checks llama.cpp's greedy tokens on the shipped Q4_1 file against minillm's
gguf format on the same file. No timing is asserted.
"""
import doctest
import sys

import pytest
import torch

from benchmarks import quant
from benchmarks import quant_llama_cpp as peer
from minillm.model.config import get_config


def _shipped_tensors():
    from minillm.model.loading import smollm2_gguf_path
    try:
        path = smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    return peer.tensor_list(path)


def test_bytes_per_token_of_the_shipped_file_match_a_count_by_hand():
    """The shipped file: every projection in Q4_1 (20 bytes per 32 weights), the norms in fp32,
    the token embedding in Q8_0 (34 bytes per 32 weights) and no output.weight: tied, so the
    whole table is read for the logits of every token."""
    c = get_config("smollm2-135m")
    kv = c.n_kv_head * c.head_dim
    per_layer = 2 * c.d_model * c.d_model + 2 * c.d_model * kv + 3 * c.d_model * c.d_ff
    q4_1 = c.n_layer * per_layer * 20 // 32
    norms = (2 * c.n_layer + 1) * c.d_model * 4
    q8_0 = c.vocab_size * c.d_model * 34 // 32
    counted = peer.read_bytes_per_token(_shipped_tensors())
    assert counted["bytes_by_type"] == {"Q4_1": q4_1, "F32": norms, "Q8_0": q8_0}
    assert counted["lm_head"] == "token_embd.weight" and counted["lm_head_type"] == "Q8_0"
    assert counted["read_per_token"] == counted["file_tensor_bytes"] == q4_1 + norms + q8_0


def test_docstring_examples_run():
    result = doctest.testmod(peer)
    assert result.attempted > 0 and result.failed == 0


def test_a_separate_output_table_leaves_one_embedding_row_read():
    tensors = [{"name": "token_embd.weight", "type": "Q8_0", "bytes": 340, "rows": 10},
               {"name": "blk.0.attn_q.weight", "type": "Q4_0", "bytes": 90, "rows": 5},
               {"name": "output.weight", "type": "Q4_0", "bytes": 180, "rows": 10}]
    counted = peer.read_bytes_per_token(tensors)
    assert counted["read_per_token"] == 90 + 180 + 34             # one row of 340 / 10 gathered
    assert counted["file_tensor_bytes"] == 610 and counted["lm_head_type"] == "Q4_0"
    with pytest.raises(ValueError, match="tensors"):
        peer.read_bytes_per_token(tensors + tensors[:1])


def test_minillm_head_takes_the_bits_of_the_output_table():
    assert [peer.head_for(t) for t in ("Q8_0", "Q4_0", "Q4_1")] == ["int8", "int4", "int4"]
    for bad in ("F32", None, "Q6_K"):
        with pytest.raises(ValueError, match="lm_head_type"):
            peer.head_for(bad)


def test_without_llama_cpp_the_peer_is_skipped_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)            # `import llama_cpp` fails
    assert "llama_cpp is not importable" in peer.unavailable()
    section = quant._llama_cpp_peer(None, [1, 2, 3], 6, 1)         # skipped before the model is used
    assert set(section) == {"skipped"} and "not importable" in section["skipped"]
    assert capsys.readouterr().out == ""
    record = {"machine": {"device": "cpu", "torch_threads": 1}, "measured_bandwidth_GBps": 10.0,
              "rows": {"fp32": {"read_bytes": 538e6, "weight_bytes": 538e6, "floor_ms": 53.8,
                                "ms_per_token": 60.0, "fraction_of_floor": 0.9}},
              "ratios": {}, "llama_cpp": section}
    lines = quant.report(record).splitlines()
    assert [x for x in lines if "llama.cpp" in x] == [f"  llama.cpp peer skipped: {section['skipped']}"]


def _row(ms, nbytes):
    return {"ms_per_token": ms, "tok_per_s": round(1e3 / ms, 2), "read_bytes": nbytes,
            "GBps": round(nbytes / ms / 1e6, 2)}


PEER = {"llama_cpp_python": "0.3.36", "threads": 1, "rounds": 5, "new_tokens": 32, "not_made": {},
        "made_files": "Q8_0, Q4_0 were made from the shipped Q4_1 file: valid for speed, not for quality",
        "rows": {"minillm fp32": _row(40.0, 538_000_000), "minillm int8": _row(25.0, 150_000_000),
                 "minillm gguf": _row(20.0, 100_000_000), "llama.cpp Q8_0": _row(10.0, 160_000_000),
                 "llama.cpp Q4_1": _row(8.0, 96_000_000)}}


def test_ratio_rows_pair_each_format_with_its_llama_cpp_file():
    """int8 with Q8_0 and gguf with Q4_1; int4 g32 has no row on either side, so no pair."""
    ratios = peer.ratio_rows(PEER["rows"], peer.PAIRS)
    assert {k: r["llama_cpp"] for k, r in ratios.items()} == {"int8": "Q8_0", "gguf": "Q4_1"}
    assert [r["tok_per_s_ratio"] for r in ratios.values()] == [0.4, 0.4]   # 10 / 25, 8 / 20
    assert ratios["int8"]["minillm_GBps"] == 6.0 and ratios["int8"]["llama_cpp_GBps"] == 16.0


def test_ratio_table_and_report_lines():
    p = {**PEER, "ratios": peer.ratio_rows(PEER["rows"], peer.PAIRS)}
    table = peer.format_ratio_table(p["ratios"]).splitlines()
    assert table[0].split() == ["minillm", "tok/s", "GB/s", "llama.cpp", "tok/s", "GB/s",
                                "minillm", "/", "llama.cpp"]
    assert table[1].split() == ["int8", "40.0", "6.00", "Q8_0", "100.0", "16.00", "0.40x"]
    assert table[2].split() == ["gguf", "50.0", "5.00", "Q4_1", "125.0", "12.00", "0.40x"]
    text = quant._report_peer(p)
    assert "1 threads, fastest of 5 alternated rounds, 32 tokens" in text
    assert "valid for speed, not for quality" in text and "\n".join(table) in text
    assert any(line.split() == ["llama.cpp", "Q4_1", "96.0", "8.00", "125.0", "12.00"]
               for line in text.splitlines())


def test_record_name_keeps_the_course_record_for_one_thread():
    assert quant.record_name("cpu", 1) == "quant"
    assert quant.record_name("cpu", 2) == "quant_threads2"
    assert quant.record_name("cuda", 2) == "quant"
    with pytest.raises(ValueError, match="threads"):
        quant.record_name("cpu", 0)


@pytest.mark.slow
def test_llama_cpp_greedy_tokens_on_the_q4_1_file_follow_minillm_gguf(smollm2):
    """The same Q4_1 file through llama.cpp and through minillm's gguf format (its Q4_1 blocks as
    they are, the fp32 decode of the file's Q8_0 table as lm_head). They need not agree token for
    token: llama.cpp rounds the activations to 8 bits before each block dot product and minillm
    does not, so where two logits nearly tie the argmax may differ, and from there on the
    contexts differ. Checked: the first token is the same, and along llama.cpp's own tokens
    (teacher-forced through minillm) each of its tokens is within minillm's top 3."""
    pytest.importorskip("llama_cpp")
    import copy

    from minillm.model.chat import encode_chat
    from minillm.model.generate import generate
    from minillm.model.loading import smollm2_gguf_path
    from minillm.quant.api import quantize
    model, tok = smollm2
    prompt, n = encode_chat(tok, quant.PROMPT), 12
    theirs = peer.greedy_run(smollm2_gguf_path(), prompt, torch.get_num_threads(), n)(n)
    q = quantize(copy.deepcopy(model), method="gguf")
    ours = generate(q, prompt, n)
    assert theirs[0] == ours[0]
    with torch.inference_mode():
        logits = q(torch.tensor([prompt + theirs[:-1]]))[0, len(prompt) - 1:]   # (n, V)
    top3 = logits.topk(3, dim=-1).indices                                         # (n, 3)
    assert all(t in row for t, row in zip(theirs, top3.tolist())), (theirs, ours)
