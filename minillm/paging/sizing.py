"""How many KV blocks the engine's pool and its host tier get, from an `EngineConfig` (read by
attribute, so this floor imports no engine file).

Pool size, in order: `num_blocks` if given (vLLM's num_gpu_blocks_override); on a CUDA device with
`gpu_memory_utilization` set, N = floor((u * total - weights - activations) / bytes per block),
the arithmetic of `kv_math.plan_capacity`, but with the weights and the activation peak measured
on the device; otherwise `kv_cache_memory_bytes` // bytes per block. On a CPU
`gpu_memory_utilization` is ignored with a warning, so one script runs on a laptop and a GPU.
Bytes per block follow `kv_cache_dtype` (scales included): int8 or fp8 KV gets about 2x (bf16)
or 4x (fp32) the blocks of the same memory. The host KV tier's slots (`offload_num_blocks`) are
`kv_offloading_size` GiB // the same bytes per block, refused beyond the host memory available.

Left out on purpose: memory held by other processes (vLLM checks free memory at start-up) and
CUDA-graph memory.
"""
import math
import warnings

import torch

from minillm._validate import check_real
from minillm.paging.host_pool import host_num_blocks
from minillm.paging.paged_cache import PagedKVCache


def num_blocks_for_memory(total_bytes: float, utilization: float, weight_bytes: float,
                          activation_bytes: float, cfg, block_size: int,
                          dtype=torch.float32, kv_cache_dtype: str = "auto") -> int:
    """N = floor((utilization * total - weights - activations) / (P * KV bytes per token)).

    The same arithmetic as `kv_math.plan_capacity`, for measured weight and activation bytes.
    """
    check_real("gpu_memory_utilization", utilization, 0, 1, low_open=True)
    kv_budget = utilization * total_bytes - weight_bytes - activation_bytes
    per_block = PagedKVCache.bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
    if kv_budget < per_block:
        raise ValueError(f"gpu_memory_utilization={utilization} of {total_bytes / 2**30:.2f} GiB "
                         f"leaves no KV block after weights ({weight_bytes / 2**30:.2f} GiB) and "
                         f"activations ({activation_bytes / 2**30:.2f} GiB)")
    return int(math.floor(kv_budget / per_block))


def param_bytes(*models) -> int:
    """Bytes of the models' parameters (a tied embedding counted once)."""
    seen, total = set(), 0
    for m in models:
        for p in (m.parameters() if m is not None else ()):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


@torch.no_grad()
def measure_activation_bytes(model, num_tokens: int) -> int:
    """Peak CUDA memory above the weights during one forward of `num_tokens` tokens."""
    device = next(model.parameters()).device
    num_tokens = min(num_tokens, model.config.max_seq_len)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    model(torch.zeros(1, num_tokens, dtype=torch.long, device=device))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _bytes_per_block(model, config) -> int:
    param = next(model.parameters())
    return PagedKVCache.bytes_per_block(model.config, config.block_size, param.dtype,
                                        config.kv_cache_dtype)


def pool_num_blocks(model, config, draft_model=None) -> int:
    """How many KV blocks the engine's pool gets (the order is in the module docstring)."""
    if config.num_blocks is not None:
        return config.num_blocks
    param = next(model.parameters())
    if config.gpu_memory_utilization is not None:
        if param.device.type == "cuda":
            total = torch.cuda.mem_get_info(param.device)[1]
            act = measure_activation_bytes(model, config.max_num_batched_tokens)
            return num_blocks_for_memory(total, config.gpu_memory_utilization,
                                         param_bytes(model, draft_model), act, model.config,
                                         config.block_size, param.dtype, config.kv_cache_dtype)
        warnings.warn(f"gpu_memory_utilization is ignored on {param.device.type}: the pool is "
                      f"sized by kv_cache_memory_bytes={config.kv_cache_memory_bytes}")
    return max(1, config.kv_cache_memory_bytes // _bytes_per_block(model, config))


def offload_num_blocks(model, config) -> int:
    """Host-tier slots for `config.kv_offloading_size` GiB (0: no tier; paging/host_pool.py)."""
    if not config.kv_offloading_size:
        return 0
    return host_num_blocks(config.kv_offloading_size, _bytes_per_block(model, config))
