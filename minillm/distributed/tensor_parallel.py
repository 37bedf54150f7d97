"""Tensor parallelism (Megatron-LM's split, vLLM's names): which sizes work, and each rank's weights.

Letters: n ranks (`tensor_parallel_size`), r this rank, H query heads, Hkv KV heads, D head dim,
C model width, F MLP width, V vocab, Vn = ceil(V / n) vocab rows per rank.

    qkv_proj, gate_up_proj   column-parallel: rank r keeps its output rows (heads r*H/n.., F/n rows)
    o_proj, down_proj        row-parallel: rank r keeps the input columns its heads / rows produce,
                             its partial sums meet in one all-reduce (tp_layers.RowParallelLinear)
    embed, lm_head           split by vocab rows, padded to n * Vn (tp_layers)
    norms                    replicated (C floats each)

2 all-reduces per layer, 1 for the embedding, 1 all-gather of the logits. A shard is an ordinary
`Transformer` of `shard_config(cfg, n)` with the parallel layers swapped in (`build_shard`), so
llama.py's forward runs unchanged on every rank.

Left out on purpose: replicating KV heads when n > Hkv (vLLM does; here such sizes are refused),
sequence parallelism, uneven head splits, and quantized shards.
"""
import torch

from minillm.distributed.tp_layers import (ParallelLMHead, RowParallelLinear, SoloComm,
                                           VocabParallelEmbedding)
from minillm.model.config import ModelConfig
from minillm.model.llama import Transformer


def allowed_sizes(cfg: ModelConfig) -> list[int]:
    """Sizes that split both the query heads and the KV heads evenly (SmolLM2: [1, 3])."""
    return [n for n in range(1, cfg.n_kv_head + 1)
            if cfg.n_head % n == 0 and cfg.n_kv_head % n == 0]


def check_tensor_parallel_size(cfg: ModelConfig, n) -> int:
    """`n` if it is an int this model can be split into, else TypeError / ValueError saying which
    sizes work."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"tensor_parallel_size must be an int, got {type(n).__name__}")
    sizes = allowed_sizes(cfg)
    if n not in sizes:
        raise ValueError(
            f"tensor_parallel_size={n} does not split {cfg.name}'s {cfg.n_head} query heads and "
            f"{cfg.n_kv_head} KV heads evenly; sizes that work: {sizes}. (vLLM also runs sizes "
            f"above the {cfg.n_kv_head} KV heads by replicating each KV head on "
            f"n / {cfg.n_kv_head} ranks; minillm leaves that out.)")
    return n


def shard_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """One rank's shape: H/n heads, Hkv/n KV heads, F/n MLP rows, ceil(V/n) vocab rows, untied."""
    check_tensor_parallel_size(cfg, n)
    return cfg.with_(n_head=cfg.n_head // n, n_kv_head=cfg.n_kv_head // n, d_ff=cfg.d_ff // n,
                     vocab_size=-(-cfg.vocab_size // n), tie_embeddings=False)


def _vocab_rows(w: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows rank*Vn..(rank+1)*Vn of w (V, C), zero rows past V: (Vn, C)."""
    V = w.shape[0]
    vn = -(-V // n)
    out = torch.zeros(vn, w.shape[1], dtype=w.dtype, device=w.device)
    part = w[rank * vn:min(V, (rank + 1) * vn)]
    out[:part.shape[0]] = part
    return out


def shard_state_dict(sd: dict, cfg: ModelConfig, rank: int, n: int) -> dict:
    """Rank `rank`'s slice of a full `Transformer` state dict (new contiguous tensors)."""
    check_tensor_parallel_size(cfg, n)
    if not isinstance(rank, int) or not 0 <= rank < n:
        raise ValueError(f"rank must be an int in [0, {n}), got {rank!r}")
    H, Hkv, D, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
    h, hkv, f = H // n, Hkv // n, F // n
    # tied embeddings: one tensor under two names; split it once, keep it shared
    tied = ("lm_head.weight" not in sd
            or sd["lm_head.weight"].data_ptr() == sd["embed.weight"].data_ptr())
    out = {}
    for name, w in sd.items():
        if name == "lm_head.weight" and tied:
            continue
        if name.endswith("qkv_proj.weight"):                  # rows: q (H*D), k (Hkv*D), v (Hkv*D)
            q, k, v = w.split([H * D, Hkv * D, Hkv * D])
            parts = [q[rank * h * D:(rank + 1) * h * D], k[rank * hkv * D:(rank + 1) * hkv * D],
                     v[rank * hkv * D:(rank + 1) * hkv * D]]
            out[name] = torch.cat(parts)                       # ((h + 2hkv) D, C)
        elif name.endswith("gate_up_proj.weight"):            # rows: gate (F), up (F)
            gate, up = w.split([F, F])
            out[name] = torch.cat([gate[rank * f:(rank + 1) * f], up[rank * f:(rank + 1) * f]])
        elif name.endswith("o_proj.weight"):                  # (C, H*D): this rank's head columns
            out[name] = w[:, rank * h * D:(rank + 1) * h * D].contiguous()
        elif name.endswith("down_proj.weight"):               # (C, F): this rank's MLP columns
            out[name] = w[:, rank * f:(rank + 1) * f].contiguous()
        elif name in ("embed.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, rank, n)                # (Vn, C)
        else:                                                  # norms: replicated
            out[name] = w.detach().clone()
    if tied:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def full_state(shards: list[dict], cfg: ModelConfig) -> dict:
    """The inverse of `shard_state_dict` over all n ranks' shards (for tests): the full state."""
    n = len(shards)
    H, Hkv, D, F, V = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    h, hkv, f = H // n, Hkv // n, F // n
    out = {}
    for name in shards[0]:
        ws = [s[name] for s in shards]
        if name.endswith("qkv_proj.weight"):
            split = [w.split([h * D, hkv * D, hkv * D]) for w in ws]
            out[name] = torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
        elif name.endswith("gate_up_proj.weight"):
            split = [w.split([f, f]) for w in ws]
            out[name] = torch.cat([torch.cat([s[i] for s in split]) for i in range(2)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.cat(ws, dim=1)
        elif name in ("embed.weight", "lm_head.weight"):
            out[name] = torch.cat(ws)[:V]
        else:
            out[name] = ws[0]
    return out


def build_shard(shard_sd: dict, cfg: ModelConfig, rank: int, n: int, comm=None) -> Transformer:
    """Rank `rank`'s model: a `Transformer` of `shard_config(cfg, n)` holding `shard_sd`, its
    o_proj / down_proj / embed / lm_head swapped for the parallel layers over `comm`
    (None: `SoloComm`, only for n = 1)."""
    if comm is None and n != 1:
        raise ValueError(f"build_shard needs a comm for n={n} (a SoloComm passed on purpose gives "
                         f"each rank's partial sums, unreduced, as the tests use)")
    comm = SoloComm() if comm is None else comm
    if not isinstance(comm, SoloComm) and comm.world_size != n:
        raise ValueError(f"comm has world_size {comm.world_size}, but n={n}")
    w = shard_sd["embed.weight"]
    with torch.device("meta"):
        model = Transformer(shard_config(cfg, n))
    model.load_state_dict(shard_sd, assign=True)              # the shard's own tensors, no copy
    for layer in model.layers:
        layer.attn.o_proj = RowParallelLinear(layer.attn.o_proj, comm)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, comm)
    model.embed = VocabParallelEmbedding(model.embed.weight, rank, comm)
    model.lm_head = ParallelLMHead(model.lm_head.weight, cfg.vocab_size, comm)
    model.full_config = cfg
    return model.eval()


def shard_model(model: Transformer, n: int, rank: int = 0, comm=None) -> Transformer:
    """`build_shard` of a full model's own weights (n = 1 with no comm: the model, re-wrapped)."""
    cfg = model.config
    return build_shard(shard_state_dict(model.state_dict(), cfg, rank, n), cfg, rank, n, comm)
