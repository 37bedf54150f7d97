"""Running a model one decoder block at a time on calibration tokens, and catching what flows
into its projections: what GPTQ, AWQ and the outlier census all need.

Letters: B calibration sequences, T tokens each, C d_model, K a projection's input width.

`BlockRunner(model, ids)` holds the block input x (B, T, C) (the embeddings at first) and the
rotary tables; `runner.run(block, i, x)` is exactly what `Transformer.forward` does with layer i
(dense causal attention, no cache). `capture(runner, block, i, x, module)` returns the input of
one projection (B*T, K), stopping the block there; `record(...)` the inputs of several in one
full pass.

Left out on purpose: padding and masks (calibration rows are all full), batching rows in chunks.
"""
import torch

from minillm.model.llama import DenseCausalAttention, rope_cos_sin
from minillm.quant.targets import check_ids


class _Stop(Exception):
    """Raised by a hook once it has what it came for: the rest of the block need not run."""


class BlockRunner:
    def __init__(self, model, ids):
        ids = check_ids("calibration", ids, model.config.vocab_size, min_len=2)
        self.positions = torch.arange(ids.shape[1], device=model.device)[None]    # (1, T)
        cos, sin = rope_cos_sin(self.positions, model.config.head_dim, model.config.rope_theta,
                                model.dtype)
        self.cos, self.sin = cos[:, None], sin[:, None]                         # (1, 1, T, D)
        self.cache = DenseCausalAttention()
        with torch.no_grad():
            self.x0 = model.embed(ids.to(model.device))                         # (B, T, C)

    @torch.no_grad()
    def run(self, block, i: int, x: torch.Tensor) -> torch.Tensor:
        return block(x, self.cos, self.sin, self.cache, i, self.positions)     # (B, T, C)


def _flat(inputs) -> torch.Tensor:
    x = inputs[0].detach()
    return x.reshape(-1, x.shape[-1])                                           # (B*T, K)


def capture(runner: BlockRunner, block, i: int, x, module) -> torch.Tensor:
    """The input `module` (inside `block`) receives when the block runs on x: (B*T, K)."""
    got = {}

    def hook(_, inputs):
        got["x"] = _flat(inputs)
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        runner.run(block, i, x)
    except _Stop:
        pass
    finally:
        handle.remove()
    return got["x"]


def record(runner: BlockRunner, block, i: int, x, modules: dict) -> tuple[dict, torch.Tensor]:
    """The inputs of each named module (B*T, K) and the block's output, from one full pass."""
    got, handles = {}, []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(
            lambda _, inputs, name=name: got.__setitem__(name, _flat(inputs))))
    try:
        out = runner.run(block, i, x)
    finally:
        for h in handles:
            h.remove()
    return got, out
