"""The engine step as one graph with attention left out: what `compiled_steps.py` compiles.

Letters: M rows of a step (its prefill chunks and decodes flattened), C model width.

`_Body` is the model's forward for the rows of one engine step (embedding, every layer, final
norm; no lm_head), written so `torch.export` can take it whole: the paged attention, whose shapes
and metadata change every step, enters as one opaque custom op, `minillm::paged_attention`, so
the compiler sees, and fuses, only the pieces between two attention calls. The op reads the
step's paged cache from `active_cache(cache)`, per thread, never from a tensor the graph holds.
`compile_package` exports and compiles a body ahead of time into a package on disk;
`example_inputs` are the ids and positions every size is exported, checked and timed at;
`weights_digest` names a model's packages.

Left out on purpose: the lm_head (it reads only the rows that sample, eager), and any cache
layout but the paged one.
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import warnings

import torch
import torch.nn as nn

from minillm.kernels.compiled import _env
from minillm.model.llama import rope_cos_sin

CONTEXT = 64                  # cached tokens per row while sizes are checked and timed
_ACTIVE = threading.local()   # .cache: the paged cache this thread's compiled graphs attend over


@contextlib.contextmanager
def active_cache(cache):
    """Make `cache` (a PagedKVCache, `prepare`d for this step) the one the attention op reads."""
    _ACTIVE.cache = cache
    try:
        yield
    finally:
        _ACTIVE.cache = None


@torch.library.custom_op("minillm::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q (M, H, D), k/v (M, Hkv, D) -> (M, H, D): the active cache's `attend_rows` (write the new
    K/V through its slot mapping, attend over its block tables), opaque to the compiler."""
    cache = getattr(_ACTIVE, "cache", None)
    if cache is None:
        raise RuntimeError("minillm::paged_attention called outside active_cache(...)")
    return cache.attend_rows(layer, q, k, v).contiguous()


@paged_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)                                   # contiguous, as the real one


class _Body(nn.Module):
    """Embedding, every layer (attention through the opaque op) and the final norm: (1, M) ids,
    (M,) positions -> hidden (M, C). The arithmetic of `llama.py`, one row per token."""

    def __init__(self, twin):
        super().__init__()
        self.twin = twin

    def forward(self, input_ids, positions):
        m, cfg = self.twin, self.twin.config
        H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        M = input_ids.shape[1]
        cos, sin = rope_cos_sin(positions, D, cfg.rope_theta, m.dtype)    # (M, D)
        cos, sin = cos[:, None], sin[:, None]                              # (M, 1, D)
        x = m.embed(input_ids[0])                                          # (M, C)
        for i, blk in enumerate(m.layers):
            qkv = blk.attn.qkv_proj(blk.input_norm(x)).view(M, H + 2 * Hkv, D)
            qk = qkv[:, :H + Hkv]
            qk = qk * cos + torch.cat([-qk[..., D // 2:], qk[..., :D // 2]], -1) * sin
            y = paged_attention(qk[:, :H], qk[:, H:], qkv[:, H + Hkv:], i)   # (M, H, D)
            x = x + blk.attn.o_proj(y.reshape(M, H * D))
            x = x + blk.mlp(blk.post_attn_norm(x))
        return m.norm(x)                                                   # (M, C)



def weights_digest(model) -> str:
    """A hash of the model's config and every parameter's bytes (about a second for 135M)."""
    h = hashlib.sha1(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def example_inputs(vocab_size: int, size: int, device, seed: int = 0):
    """The (1, size) token ids and (size,) positions a size is exported, checked and timed at."""
    g = torch.Generator().manual_seed(seed + size)
    ids = torch.randint(vocab_size, (1, size), generator=g).to(device)
    return ids, torch.full((size,), CONTEXT, dtype=torch.long, device=device)


def compile_package(body: nn.Module, ids, pos, path: str, cache_dir: str, mode: str) -> None:
    """Export `body` at the shapes of (ids, pos), compile it ahead of time with frozen weights
    (max-autotune unless `mode` is "default") and save the package at `path`, atomically.
    Inductor's own caches go under `cache_dir`."""
    opts = {"freezing": True, "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False,
            **({"max_autotune": True} if mode != "default" else {})}
    os.makedirs(cache_dir, exist_ok=True)
    with _env("TORCHINDUCTOR_CACHE_DIR", cache_dir), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        program = torch.export.export(body, (ids, pos))
        tmp = f"{path}.{os.getpid()}.tmp.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=tmp, inductor_configs=opts)
    os.replace(tmp, path)                 # atomic: a reader sees a whole package or none
