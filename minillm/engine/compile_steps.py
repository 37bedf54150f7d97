"""`python -m minillm compile-steps [--sizes 1,2,4,8,16] [--threads N] [--mode M]`: compile the
engine's steps for the default model ahead of time, so no engine waits for them.

It loads SmolLM2 as `LLM(...)` does, compiles one package per padded row count
(`kernels/compiled_steps.py`; minutes per size the first time on a machine, progress printed),
checks each against eager, times it, saves the verdicts when the machine was quiet, and prints
which sizes were kept and where the packages are. A later `LLM(..., compilation_config={...})`
with the same sizes, threads and mode loads them in seconds.

Left out on purpose: models other than the default (an engine built with `compilation_config`
compiles its own model), and tensor parallelism.
"""
import argparse
import logging
import sys

import torch

from minillm.kernels import compiled_steps as cs
from minillm.kernels.compiled import inductor_cache_dir
from minillm.model.loading import load_model
from minillm.paging.paged_cache import PagedKVCache


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minillm compile-steps",
                                description="Compile the engine's steps per padded row count.")
    p.add_argument("--sizes", default=None,
                   help="the padded row counts, comma-separated (default 1,2,4,8,16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--mode", default=None, help="inductor's mode (default max-autotune-no-cudagraphs)")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    fields = {} if args.mode is None else {"mode": args.mode}
    if args.sizes is not None:
        try:
            fields["compile_sizes"] = tuple(int(x) for x in args.sizes.split(","))
        except ValueError:
            p.error(f"--sizes must be comma-separated ints, got {args.sizes!r}")
    try:
        cc = cs.CompilationConfig(**fields)
    except ValueError as e:
        p.error(str(e))
    log = logging.getLogger("minillm")
    if not log.handlers:                                  # the compile's one-line notices
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("minillm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    model, _ = load_model(device="cpu")
    steps = cs.CompiledSteps(model, cc).compile(
        lambda n, size: PagedKVCache(model.config, n, size), progress=lambda line: print(line, flush=True))
    print(steps.summary())
    print(f"packages: {cc.cache_dir or inductor_cache_dir()}")


if __name__ == "__main__":
    main()
