"""The layers of a tensor-parallel shard that talk to the other ranks (vLLM's names).

Letters: B batch, T tokens, C model width, I a row-parallel layer's local input width,
Vn vocab rows per rank (padded: n * Vn >= V), V the real vocab.

    RowParallelLinear       y = all_reduce(x_local @ W_local^T)    (B, T, I) -> (B, T, C)
    VocabParallelEmbedding  ids outside this rank's rows look up 0, then all_reduce -> (B, T, C)
    ParallelLMHead          local logits (B, T, Vn), all_gather on the vocab dim, padding cut -> V
    SoloComm                the same calls for one process (n = 1): nothing to talk to

Column-parallel layers (qkv_proj, gate_up_proj) need no class: each rank's slice is an ordinary
`nn.Linear` whose output stays local until the row-parallel layer after it.

Left out on purpose: reduce-scatter / sequence parallelism, gathering logits to one rank only
(every rank gets them here, as all_gather gives them), biases.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SoloComm:
    """`Comm`'s collectives for a group of one: all_reduce and all_gather return their input."""

    rank, world_size = 0, 1

    def __init__(self):
        self.stats: dict[str, dict] = {}

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def broadcast_object(self, obj=None, src: int = 0):
        return obj

    def reset_stats(self) -> None:
        self.stats = {}


class RowParallelLinear(nn.Module):
    """A linear layer split by input columns: each rank multiplies its slice of the input by its
    columns of W, and the partial sums meet in one all-reduce. Wraps the rank's `nn.Linear`."""

    def __init__(self, linear: nn.Linear, comm):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("RowParallelLinear: a bias would be added n times; none is supported")
        self.linear, self.comm = linear, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight                                  # (C, I)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(F.linear(x, self.linear.weight))   # (B, T, I) -> (B, T, C)


class VocabParallelEmbedding(nn.Module):
    """Rank r holds embedding rows r*Vn..(r+1)*Vn. Ids outside them look up row 0 and are zeroed,
    so the all-reduce adds exactly one real row per token."""

    def __init__(self, weight: torch.Tensor, rank: int, comm):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight,
                                                                                  requires_grad=False)
        self.comm = comm
        self.start = rank * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start                                   # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)   # (B, T, C)
        x = x.masked_fill(outside[..., None], 0.0)
        return self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Rank r's logits for vocab rows r*Vn..(r+1)*Vn, all-gathered to every rank; the padding
    rows past `vocab_size` are cut."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, comm):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight,
                                                                                  requires_grad=False)
        self.comm, self.vocab_size = comm, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)                           # (B, T, Vn)
        return self.comm.all_gather(local, dim=-1)[..., :self.vocab_size]   # (B, T, V)
