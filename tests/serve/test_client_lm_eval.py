"""An evaluation harness through the server: lm-eval (PyPI) scores a small multiple-choice task
through `/v1/completions` with its `local-completions` model, and on the same weights with its
Hugging Face backend (`hf`, transformers' own forward pass: the reference).

The task ships beside this file (lm_eval_task/: a YAML config and eight questions in JSONL;
nothing is downloaded, the datasets cache goes to a temporary folder). lm-eval tokenizes each
question + choice itself and asks the server for the prompt's log-probabilities (`echo: true`,
`logprobs: 1`, `max_tokens: 1`, the prompt as token ids); the tiny random model is saved as a
transformers folder for `hf`. Every choice's log-likelihood agrees within 1e-4 nats (both fp32,
different kernels), and so do the greedy flags and the accuracy, with prefix caching on too (a
scoring request skips the cache, as in vLLM). Four prompts in one request (lm-eval's
batch_size=4) is refused today and expected to fail until the server takes a list of prompts.
"""
import math
import os
from pathlib import Path

import pytest
import yaml

from minillm.model.hf_convert import to_hf_model
from minillm.serve import running
from serve_tiny import MODEL, settles, tiny_llm  # noqa: F401 (settles: an autouse fixture)

# datasets reads these when it is imported: the task's JSONL is local, nothing may be downloaded.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (the dev extra)")
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.evaluator import evaluate  # noqa: E402
from lm_eval.tasks import TaskManager, get_task_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASK = Path(__file__).parent / "lm_eval_task" / "minillm_mc.yaml"
ATOL = 1e-4                       # nats, per choice


@pytest.fixture(scope="module")
def llm(tok):
    return tiny_llm(tok)


@pytest.fixture(scope="module")
def hf_folder(llm, tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_hf")
    to_hf_model(llm.model).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The shipped config, its data path made absolute (it is relative to the repository root)."""
    cfg = yaml.safe_load(TASK.read_text())
    files = cfg["dataset_kwargs"]["data_files"]
    cfg["dataset_kwargs"] = {"data_files": {k: str(ROOT / v) for k, v in files.items()},
                             "cache_dir": str(tmp_path_factory.mktemp("datasets"))}
    return cfg


def run(lm, task) -> tuple[float, list[list[tuple[float, bool]]]]:
    """(accuracy, per question the (log-likelihood, is greedy) of each choice)."""
    tasks = get_task_dict([task], TaskManager(include_defaults=False))
    out = evaluate(lm=lm, task_dict=tasks, log_samples=True)
    samples = sorted(out["samples"][task["task"]], key=lambda s: s["doc_id"])
    return out["results"][task["task"]]["acc,none"], [[r[0] for r in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def reference(hf_folder, task):
    return run(get_model("hf")(pretrained=str(hf_folder), dtype="float32", device="cpu",
                               batch_size=4), task)


@pytest.fixture(scope="module")
def srv(request, tok):
    with running(tiny_llm(tok, enable_prefix_caching=request.param), served_model_name=MODEL) as s:
        yield s


CASES = [pytest.param(False, 1, id="one_prompt_per_request"),
         pytest.param(False, 4, id="four_prompts_per_request", marks=pytest.mark.xfail(
             strict=False, reason="a list of prompts in one request is refused today")),
         pytest.param(True, 1, id="prefix_caching")]


@pytest.mark.parametrize("srv, batch_size", CASES, indirect=["srv"])
def test_lm_eval_scores_the_same_through_the_server_as_through_transformers(srv, hf_folder, task,
                                                                            reference, batch_size):
    lm = get_model("local-completions")(
        model=MODEL, base_url=srv.base_url + "/completions", tokenizer_backend="huggingface",
        tokenizer=str(hf_folder), batch_size=batch_size, num_concurrent=1, max_retries=1)
    acc, scores = run(lm, task)
    ref_acc, ref_scores = reference
    assert len(scores) == len(ref_scores) == 8 and all(len(s) == 4 for s in scores)
    for got, want in zip(scores, ref_scores):
        assert [g for _, g in got] == [g for _, g in want]
        assert all(ll < 0 for ll, _ in got)
        for (ll, _), (ref, _) in zip(got, want):
            assert math.isclose(ll, ref, rel_tol=0, abs_tol=ATOL), (ll, ref)
    assert acc == ref_acc
    assert len({round(ll, 3) for s in ref_scores for ll, _ in s}) > 16   # scores that differ
