"""GPTQ: int4 weights with second-order error compensation, one linear layer at a time.

Letters: N output features, K input features, G group size, T calibration tokens, X (T, K).

The error on calibration inputs is tr((W - Q) H (W - Q)^T), H = 2 X^T X. Columns are rounded left
to right; with U the upper Cholesky factor of H^-1, rounding column j updates the free ones by
e = (w_j - q_j) / U[j, j];  W[:, j+1:] -= e * U[j, j+1:]. Columns go in blocks of one group
(the rest of the matrix gets a block's updates in one matmul), and a group's scale and minimum
are fitted to the *updated* weights. `gptq_weights` quantizes the projections in forward order,
each on inputs from the model with every earlier projection already quantized.

Left out on purpose: act-order (columns by decreasing H diagonal), static groups, the lm_head
(tied to the embeddings), symmetric formats.
"""
import copy
import math
from contextlib import contextmanager

import torch

from minillm.quant.blocks import BlockRunner, capture
from minillm.quant.formats import Int4Weight, check_group_size, int4_params, round_int4
from minillm.quant.targets import PROJECTIONS, check_groups


def inverse_hessian_factor(H: torch.Tensor, damp: float = 0.01):
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 (K, K) in float64, and the dead
    columns (zero diagonal: an input that is always 0), whose diagonal is set to 1 first."""
    if not 0 <= damp < 1:
        raise ValueError(f"damp must be in [0, 1), got {damp!r}")
    H = H.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    H.diagonal().add_(damp * H.diagonal().mean())
    # U^T U = H^-1 means H = V V^T with V = U^-1 upper triangular: a Cholesky factor of H with
    # the index order reversed. One factorization and one triangular inverse, no explicit H^-1.
    V = torch.linalg.cholesky(H.flip(0, 1)).flip(0, 1)                     # (K, K), upper
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    return torch.linalg.solve_triangular(V, eye, upper=True), dead


def gptq_loop(W: torch.Tensor, U: torch.Tensor, group_size: int, fit, snap) -> torch.Tensor:
    """The column loop on a working copy W (N, K), updated in place; returns the quantized
    weights Q (N, K). `fit(W[:, group])` gives a group's parameters when its first column comes
    up; `snap(column, params, j)` returns column j on the grid. Both are arguments so a test can
    put any quantizer in (e.g. one that leaves the later columns free).

    One group is one block: when it starts, every earlier block's update has reached it, so the
    group is fitted to its updated weights. Inside the block, column j gets the updates of the
    block's earlier columns as one matrix-vector product just before it is snapped (the same
    sums as rank-1 updates after each column, far fewer operations)."""
    N, K = W.shape
    U = U.to(W.dtype)
    Q = torch.empty_like(W)
    for b0 in range(0, K, group_size):
        b1 = min(b0 + group_size, K)
        params = fit(W[:, b0:b1])
        err = torch.empty(b1 - b0, N, dtype=W.dtype, device=W.device).t()  # (N, G), columns contiguous
        for j in range(b0, b1):
            col = torch.addmv(W[:, j], err[:, :j - b0], U[b0:j, j], alpha=-1)   # (N,)
            q = Q[:, j]
            q.copy_(snap(col, params, j))
            torch.sub(col, q, out=err[:, j - b0]).div_(U[j, j])
        # W[:, b1:] -= err @ U[b0:b1, b1:], done on the transposes: W is column-major, so its
        # (rest, N) transpose is contiguous and takes the product in place
        W[:, b1:].t().addmm_(U[b0:b1, b1:].t(), err.t(), alpha=-1)       # (rest, G) @ (G, N)
    return Q


def gptq_quantize_weight(w: torch.Tensor, H: torch.Tensor, group_size: int,
                         damp: float = 0.01) -> Int4Weight:
    """GPTQ of one weight (N, K) given its calibration Hessian H (K, K), in Q4_1-style groups."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError("w must be a floating 2-D tensor (N, K)")
    N, K = w.shape
    check_group_size(group_size, K)
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (K, K):
        raise ValueError(f"H must be a ({K}, {K}) tensor, got "
                         f"{tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__}")
    U, dead = inverse_hessian_factor(H.to(w.device), damp)
    # a column-major working copy: the loop reads and writes whole columns
    W = w.detach().t().to(torch.promote_types(w.dtype, torch.float32), copy=True).contiguous().t()
    W[:, dead] = 0                                      # never multiplied by anything but 0
    scales, mins = [], []

    def fit(wg):                                        # (N, G) -> fp16 (N,), (N,), as stored
        d, m = int4_params(wg)
        scales.append(d), mins.append(m)
        d, m = d.float(), m.float()
        return d, m, torch.where(d > 0, 1 / d, torch.zeros_like(d))

    def snap(col, p, j):                                # round_int4's arithmetic, then dequantize
        d, m, inv = p
        q = (col.float() - m).mul_(inv).round_().clamp_(0, 15)
        return q.mul_(d).add_(m)                        # (d * q) + m, as Int4Weight.dequantize

    with _one_thread(W.device):
        Q = gptq_loop(W, U, group_size, fit, snap)
    d, m = torch.stack(scales, 1), torch.stack(mins, 1)                     # (N, K/G)
    codes = round_int4(Q.view(N, K // group_size, group_size), d[..., None], m[..., None])
    return Int4Weight(codes.view(N, K), d, m, group_size)


@contextmanager
def _one_thread(device: torch.device):
    """The column loop is thousands of (N,)-sized operations: on a CPU, waking a second thread
    costs more than each of them (and on a shared machine far more), so it runs on one."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hessian(X: torch.Tensor) -> torch.Tensor:
    """2 X^T X / T (K, K) from inputs X (T, K): the 1/T only rescales, the solution is the same."""
    X = X.float()
    return 2 * (X.t() @ X) / X.shape[0]                                      # (K, K)


@torch.no_grad()
def gptq_weights(model, calibration, group_size: int, damp: float = 0.01) -> dict:
    """GPTQ int4 of the four projections of every layer, keyed by module name; `model` is not
    modified (each block is quantized in a copy that then feeds the next block)."""
    check_groups(model, group_size)
    if not 0 <= damp < 1 or math.isnan(damp):
        raise ValueError(f"damp must be in [0, 1), got {damp!r}")
    runner = BlockRunner(model, calibration)
    x, out = runner.x0, {}
    for i, block in enumerate(model.layers):
        qblock = copy.deepcopy(block)
        for p in PROJECTIONS:
            lin = qblock.get_submodule(p)
            H = hessian(capture(runner, qblock, i, x, lin))
            wq = gptq_quantize_weight(lin.weight, H, group_size, damp)
            lin.weight.copy_(wq.dequantize(lin.weight.dtype))
            out[f"layers.{i}.{p}"] = wq
        x = runner.run(qblock, i, x)                    # the next block sees quantized outputs
        del qblock
    return out
