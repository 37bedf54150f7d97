"""The engine's compiled steps: made when an engine starts (`compiled_steps`, what `ModelRunner`
runs with `compilation_config`), or ahead of time by
`python -m minillm compile-steps [--sizes 1,2,4,8,16] [--threads N] [--mode M]`, so no engine waits.

The command loads SmolLM2 as `LLM(...)` does, compiles one package per padded row count
(`kernels/compiled_steps.py`; minutes per size the first time on a machine, progress printed),
checks each against eager, times it, saves the verdicts when the machine was quiet, and prints
which sizes were kept and where the packages are. A later `LLM(..., compilation_config={...})`
with the same sizes, threads and mode loads them in seconds.

Left out on purpose: models other than the default in the command (an engine built with
`compilation_config` compiles its own model), and tensor parallelism (one process only).
"""
import argparse
import dataclasses
import logging
import sys

import torch

from minillm.kernels import compiled_steps as cs
from minillm.kernels.background_steps import BackgroundSteps
from minillm.kernels.compiled import inductor_cache_dir, reference_twin
from minillm.kernels.cuda_graph_steps import cuda_graph_steps
from minillm.kernels.tuning_cache import notice
from minillm.model.loading import load_model
from minillm.paging.paged_cache import CacheSpec, PagedKVCache


def compiled_steps(model, config, spec: CacheSpec, device):
    """The model's compiled steps for `config.compilation_config`, compiled and judged now
    (progress on stderr), or None without one; on a CUDA device its piecewise CUDA graphs
    instead (`cudagraph_mode`, kernels/cuda_graph_steps.py). A model the compiler cannot take (a
    quantized one) or a compiler that fails: None, with one line saying why."""
    cc = config.compilation_config
    if cc is None:
        return None
    make = lambda n, block_size: dataclasses.replace(spec, num_blocks=n, block_size=block_size) \
        .make(model.config, device)                                          # noqa: E731
    try:
        steps = cuda_graph_steps(model, cc, make, device)        # None: no CUDA graphs here
        if steps is None and cc.background:    # eager now; the runner adopts the steps when ready
            reference_twin(model)                                 # TypeError: cannot compile
            return BackgroundSteps(model, cc, make)
        if steps is None:
            steps = cs.compiled_steps_for(model, cc, make, progress=notice)
    except TypeError as e:
        notice(f"compiled steps: none ({e}); every step eager")
        return None
    notice(steps.summary())
    return steps if steps.kept else None


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
