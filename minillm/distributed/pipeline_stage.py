"""Pipeline stages: a model cut into p contiguous pieces, and the timeline of a pipelined forward.

Letters: B batch, T tokens per sequence, C model width, V vocab, p stages, m micro-batches.

    stage 0:    embed -> layers[r0]           (B, T) ids    -> (B, T, C) hidden
    stage s:    layers[rs]                    (B, T, C)     -> (B, T, C)
    stage p-1:  layers[r_{p-1}] -> norm -> lm_head          -> (B, T', V) logits

`split_layers` decides the cut (even, or a `partition` of layer counts); `balanced_partition`
counts the last stage's lm_head and gives it fewer layers. `PipelineStage` keeps only its own
weights, under the model's names, and runs the model's `Block`s with dense causal attention or a
KV cache of its own layers (`new_cache`). `PipelineTimeline` records when each stage worked on
each micro-batch (`time.perf_counter`) and compares the measured bubble,
1 - busy / (p x span), with GPipe's (p-1)/(m+p-1).

Left out on purpose: the backward pass and 1F1B schedules, interleaved (virtual) stages, paged
KV caches.
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from minillm._validate import check_int, check_real
from minillm.analysis.parallel_math import bubble_fraction
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import KVCache
from minillm.model.llama import Block, DenseCausalAttention, RMSNorm, rope_cos_sin


def split_layers(num_layers: int, pipeline_parallel_size: int,
                 partition: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage: as even as possible (earlier stages take the
    remainder), or `partition[s]` layers for stage s (each >= 1, summing to num_layers)."""
    check_int("num_layers", num_layers, low=1)
    p = check_int("pipeline_parallel_size", pipeline_parallel_size, low=1, high=num_layers)
    if partition is None:
        base, extra = divmod(num_layers, p)
        partition = [base + (s < extra) for s in range(p)]
    elif (not isinstance(partition, (list, tuple)) or len(partition) != p
          or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in partition)
          or sum(partition) != num_layers):
        raise ValueError(f"partition must be {p} ints >= 1 summing to num_layers={num_layers}, "
                         f"got {partition!r}")
    starts = [sum(partition[:s]) for s in range(p)]
    return [range(a, a + n) for a, n in zip(starts, partition)]


def balanced_partition(cfg: ModelConfig, pipeline_parallel_size: int,
                       logits_fraction: float = 1.0) -> list[int]:
    """Layer counts per stage that even out the stages' matmul work, with lm_head counted on the
    last stage as V*d / (one layer's weights) layers, times `logits_fraction` (1: logits at every
    position, as `forward` returns them; about 1/T when only the last position's are computed,
    as in generation). Earlier stages split the rest evenly. SmolLM2-135M, p=2: [19, 11]."""
    p = check_int("pipeline_parallel_size", pipeline_parallel_size, low=1, high=cfg.n_layer)
    check_real("logits_fraction", logits_fraction, low=0, high=1)
    if p == 1:
        return [cfg.n_layer]
    d, hd = cfg.d_model, cfg.head_dim
    layer = d * (cfg.n_head + 2 * cfg.n_kv_head) * hd + cfg.n_head * hd * d + 3 * d * cfg.d_ff
    extra = logits_fraction * cfg.vocab_size * d / layer          # lm_head, in layers
    L = cfg.n_layer

    def worst(k: int) -> float:                                   # k layers on the last stage
        return max(-(-(L - k) // (p - 1)), k + extra)

    k = min(range(1, L - p + 2), key=lambda k: (worst(k), -k))
    return [len(r) for r in split_layers(L - k, p - 1)] + [k]


def stage_state_dict(state: dict, layers: range, first: bool, last: bool) -> dict:
    """The part of a full model's state dict that one stage needs, names unchanged."""
    keep = {}
    for name, t in state.items():
        part = name.split(".")
        if part[0] == "layers":
            wanted = int(part[1]) in layers
        else:
            wanted = (part[0] == "embed" and first) or (part[0] in ("norm", "lm_head") and last)
        if wanted:
            keep[name] = t
    return keep


class PipelineStage(nn.Module):
    """Layers `layers` of a model (plus the embedding on the first stage and the final norm and
    lm_head on the last), built from `state` (a state dict with the full model's names)."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool, state: dict):
        super().__init__()
        self.config, self.layer_range, self.first, self.last = cfg, layers, first, last
        with torch.device("meta"):                    # no random init: the weights come next
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if first else None
            self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in layers})
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if last else None
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last else None
        self.load_state_dict(stage_state_dict(state, layers, first, last), assign=True)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """A contiguous KV cache for this stage's layers only (indexed 0..len(layers)-1)."""
        cfg = self.config.with_(n_layer=len(self.layers))
        return KVCache(cfg, batch_size, max_seq_len, dtype=self.dtype)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, last_only: bool = False, cache: KVCache | None = None,
                start: int = 0) -> torch.Tensor:
        """ids (B, T) on the first stage, hidden (B, T, C) elsewhere -> hidden (B, T, C), or on
        the last stage logits (B, T, V) ((B, 1, V) with `last_only`). With `cache`, the T tokens
        sit at positions start..start+T-1 after the ones cached; without, attention is dense
        causal over exactly these T tokens (start must be 0)."""
        if self.first:
            x = self.embed(x)                                        # (B, T, C)
        T = x.shape[1]
        positions = torch.arange(start, start + T, device=x.device)[None]   # (1, T)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        cos, sin = cos[:, None], sin[:, None]                        # (1, 1, T, D)
        attn = cache if cache is not None else DenseCausalAttention()
        for j, layer in enumerate(self.layers.values()):
            x = layer(x, cos, sin, attn, j, positions)               # (B, T, C)
        if not self.last:
            return x
        if last_only:
            x = x[:, -1:]                                            # (B, 1, C)
        return self.lm_head(self.norm(x))                            # (B, T or 1, V)


@dataclass
class PipelineTimeline:
    """Busy intervals of one pipelined forward: `intervals[(stage, microbatch)] = (start, end)`
    in seconds from the forward's start."""

    pipeline_parallel_size: int
    num_microbatches: int
    intervals: dict = field(default_factory=dict)

    def span(self) -> float:
        """First start to last end."""
        starts = [a for a, _ in self.intervals.values()]
        return max(b for _, b in self.intervals.values()) - min(starts)

    def busy(self, stage: int | None = None) -> float:
        """Seconds spent computing, by one stage or all of them."""
        return sum(b - a for (s, _), (a, b) in self.intervals.items() if stage in (None, s))

    def bubble_fraction(self) -> float:
        """Measured idle share of the p x span stage-seconds: 1 - busy / (p x span)."""
        return 1.0 - self.busy() / (self.pipeline_parallel_size * self.span())

    def stage_idle(self) -> list[float]:
        """Each stage's idle share of the span."""
        return [1.0 - self.busy(s) / self.span() for s in range(self.pipeline_parallel_size)]

    def expected_bubble(self) -> float:
        """GPipe's formula for equal stages: (p-1)/(m+p-1)."""
        return bubble_fraction(self.pipeline_parallel_size, self.num_microbatches)

    def rows(self) -> list[tuple[int, int, float, float]]:
        """(stage, microbatch, start, end), sorted by stage then micro-batch."""
        return sorted((s, i, a, b) for (s, i), (a, b) in self.intervals.items())
