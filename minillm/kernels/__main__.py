"""`python -m minillm.kernels [--retune] [--threads N] [--allow-copies]`: tune this machine's CPU
matmul routes for the real model, with a progress bar, and print the table.

Every route is timed for each weight shape and row bucket (minutes on a 2-core machine) and the
table is cached under $MINILLM_CACHE/kernels/ with the load it was timed under; `LLM(...)`,
`minillm.load_model()`, `make demo` and `python -m minillm serve` then use it. A table already
cached is read back, not timed again (--retune times again). On a machine busy before the timing
starts nothing is timed; one that turns busy while timing saves the table marked busy and not
used. The run says so; run it again when the machine is quiet.
(`python -m minillm.kernels.cpu_tuning` is the earlier spelling of the same command.)

The engine's compiled steps (`compiled_steps.py`) are compiled ahead of time by
`python -m minillm compile-steps` (it needs the paged cache, a floor above this folder).

`--background --model NAME` is the background tuner the front door starts (`background.py`):
low priority, timing only while nothing else runs, saving the table once every shape is timed.
"""
import argparse
import logging
import sys

import torch

from minillm.kernels.cpu_tuning import accelerate, cache_path, format_plan, kernel_report
from minillm.model.loading import load_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minillm.kernels",
                                description="Time the CPU matmul routes here and cache the table.")
    p.add_argument("--retune", action="store_true", help="time again and overwrite the cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--allow-copies", action="store_true", help="let prepacked copies win")
    p.add_argument("--background", action="store_true",
                   help="time only while the machine is quiet, at low priority (what the front door starts)")
    p.add_argument("--model", default=None, help="with --background: the model's name or path")
    p.add_argument("--cache-dir", default=None, help="with --background: the tuning cache folder")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="with --background: give up after this many seconds without a quiet moment")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.background:
        from minillm.kernels.background import DEADLINE_S, run_background
        from minillm.model.loading import DEFAULT_MODEL
        deadline = DEADLINE_S if args.deadline_s is None else args.deadline_s
        if deadline <= 0:
            p.error(f"--deadline-s must be > 0, got {deadline}")
        print(run_background(args.model or DEFAULT_MODEL, torch.get_num_threads(), args.cache_dir,
                             deadline), flush=True)
        return
    log = logging.getLogger("minillm")
    if not log.handlers:                                  # tuning's one-line notices, on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("minillm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    model, _ = load_model(device="cpu")                   # the reference model, plain nn.Linear
    accelerate(model, allow_copies=args.allow_copies, retune=args.retune, tune=True)
    print(format_plan(kernel_report(model)))
    print(f"cache: {cache_path()}")


if __name__ == "__main__":
    main()
