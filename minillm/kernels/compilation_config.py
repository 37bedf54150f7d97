"""What to compile for the engine's steps (`EngineConfig.compilation_config`), checked.

`CompilationConfig` holds vLLM's names where they fit: `compile_sizes`, the padded row counts a
step can run compiled at; the compiler's mode; which sizes to keep and how sure a win must be;
where the packages go; on a GPU, `cudagraph_mode` and `cudagraph_capture_sizes` (the piecewise
CUDA graphs of `cuda_graph_steps.py`). `compilation_config(value, max_num_batched_tokens)` turns
what a user passes (None, a dict, a CompilationConfig) into a checked config, each refusal a
ValueError or TypeError naming `compilation_config`. What is done with it is `compiled_steps.py`'s
(and `cuda_graph_steps.py`'s).
"""
from dataclasses import dataclass, fields

from minillm._validate import check_int
from minillm.kernels.compiled import MIN_GAIN, check_mode

DEFAULT_SIZES = (1, 2, 4, 8, 16)
KEEP = ("faster", "agreeing")
CUDAGRAPH_MODES = (None, "none", "piecewise")


@dataclass(frozen=True)
class CompilationConfig:
    """What to compile (vLLM's names where they fit). `compile_sizes`: the padded row counts,
    strictly increasing, each <= the engine's max_num_batched_tokens; `mode`: inductor's mode;
    `keep`: "faster" keeps a size where it agrees with eager and beats it, "agreeing" wherever
    it agrees (to study the compiled steps whatever their speed); `min_gain` and `rounds`: how
    sure a win must be; `cache_dir`: the folder of the compiled packages and inductor's caches
    (None: `inductor_cache_dir()`, keyed by this machine); `background`: build the engine at
    once and compile while it serves eager (`background_steps.py`) instead of before;
    `cudagraph_mode`: "piecewise" captures the pieces between attention calls as CUDA graphs
    (cuda_graph_steps.py) instead of compiling, "none" never does, None: "piecewise" on a CUDA
    device, "none" elsewhere (an explicit "piecewise" without CUDA is ignored with one line);
    `cudagraph_capture_sizes`: the padded row counts captured, checked as compile_sizes (None:
    compile_sizes)."""

    compile_sizes: tuple = DEFAULT_SIZES
    mode: str = "max-autotune-no-cudagraphs"
    keep: str = "faster"
    min_gain: float = MIN_GAIN
    rounds: int = 5
    cache_dir: str | None = None
    background: bool = False
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple | None = None

    def __post_init__(self):
        object.__setattr__(self, "compile_sizes", _sizes("compile_sizes", self.compile_sizes))
        if self.cudagraph_capture_sizes is not None:
            object.__setattr__(self, "cudagraph_capture_sizes",
                               _sizes("cudagraph_capture_sizes", self.cudagraph_capture_sizes))
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config.cudagraph_mode must be one of "
                             f"{list(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        try:
            check_mode(self.mode)
        except ValueError as e:
            raise ValueError(f"compilation_config.{e}") from None
        if self.keep not in KEEP:
            raise ValueError(f"compilation_config.keep must be one of {list(KEEP)}, got {self.keep!r}")
        if not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain < 1:
            raise ValueError(f"compilation_config.min_gain must be in [0, 1), got {self.min_gain!r}")
        check_int("compilation_config.rounds", self.rounds, 1)
        if not isinstance(self.background, bool):
            raise TypeError(f"compilation_config.background must be a bool, got {self.background!r}")

    @property
    def capture_sizes(self) -> tuple:
        """The sizes CUDA graphs are captured for: cudagraph_capture_sizes, else compile_sizes."""
        return self.cudagraph_capture_sizes or self.compile_sizes


def _sizes(name: str, sizes) -> tuple:
    """A non-empty, strictly increasing list of ints >= 1 -> a tuple; else ValueError naming
    compilation_config.<name>."""
    if isinstance(sizes, int) or not isinstance(sizes, (list, tuple)) or not sizes:
        raise ValueError(f"compilation_config.{name} must be a non-empty list of ints "
                         f">= 1 in increasing order, got {sizes!r}")
    for i, s in enumerate(sizes):
        check_int(f"compilation_config.{name}[{i}]", s, 1)
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"compilation_config.{name} must be strictly increasing, got {list(sizes)}")
    return tuple(sizes)


def compilation_config(value, max_num_batched_tokens: int) -> CompilationConfig | None:
    """None, a dict of `CompilationConfig` fields or a `CompilationConfig` -> a checked config
    (or None). Every size must fit one step's token budget."""
    if value is None or isinstance(value, CompilationConfig):
        cc = value
    elif isinstance(value, dict):
        allowed = [f.name for f in fields(CompilationConfig)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"compilation_config has unknown keys {unknown}; allowed: {allowed}")
        cc = CompilationConfig(**value)
    else:
        raise TypeError(f"compilation_config must be None, a dict or a CompilationConfig, "
                        f"got {type(value).__name__}")
    for name in ("compile_sizes", "cudagraph_capture_sizes"):
        sizes = getattr(cc, name, None)
        if sizes and sizes[-1] > max_num_batched_tokens:
            raise ValueError(f"compilation_config.{name} go up to {sizes[-1]}, above "
                             f"max_num_batched_tokens={max_num_batched_tokens} (no step has more rows)")
    return cc
