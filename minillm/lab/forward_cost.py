"""What one forward over N new tokens costs on this machine (chapters 0, 5 and 6).

`forward_cost` times one forward of N new tokens after a cached context, per matmul route, in
interleaved rounds: the cost curve a decode batch, a speculative verify step and a prefill chunk
pay. Beside it, in the same rounds, the same forwards' matmuls alone (`measure.decode_matmuls`),
and from the two `least_forward_ratio`: how low forward(N) / forward(1) could go with these
kernels if nothing but the matmuls grew with N. The decode benchmark records both
(`python -m benchmarks decode`).

Letters: N new tokens of a forward.
Left out on purpose: batches of more than one row (a verify step and a prefill chunk have one).
"""
import statistics
import time

import torch

from minillm.kernels.cpu_kernels import linear_route
from minillm.lab.common import prefilled
from minillm.lab.measure import decode_matmuls

COST_ROWS = (1, 2, 4, 9, 17, 33, 64)


@torch.inference_mode()
def forward_cost(model, rows=COST_ROWS, context: int = 128, rounds: int = 5,
                 routes=("auto", "F.linear"), matmuls: bool = False) -> dict:
    """Median ms of one forward over `rows` new tokens with `context` cached, per `Linear` route
    ("auto": the model's tuned table); rounds interleave every case so drift spreads evenly.
    With `matmuls`, also "matmuls": the same forwards' matmuls alone (`decode_matmuls` at N rows,
    the tuned routes), timed in the same rounds."""
    _, forward = prefilled(model, 1, context, max(rows))
    alone = {n: decode_matmuls(model, n) for n in rows} if matmuls else {}
    samples = {(r, n): [] for r in routes for n in rows} | {("matmuls", n): [] for n in alone}
    for _ in range(rounds):
        for (route, n), times in samples.items():
            x = torch.ones(1, n, dtype=torch.long, device=model.device)
            with linear_route("auto" if route == "matmuls" else route):
                t0 = time.perf_counter()
                alone[n]() if route == "matmuls" else forward(x)
                times.append(1e3 * (time.perf_counter() - t0))
    return {r: {str(n): round(statistics.median(samples[(r, n)]), 2) for n in rows}
            for r in (*routes, *(["matmuls"] if alone else []))}


def least_forward_ratio(cost: dict) -> dict:
    """N -> the least forward(N) / forward(1) these matmul kernels allow: 1 + (matmuls(N) -
    matmuls(1)) / forward(1), from `forward_cost(..., matmuls=True)`'s "auto" and "matmuls". A
    forward over N tokens runs its matmuls at N rows and at least the other work of a 1-token
    forward, so its time is at least forward(1) + matmuls(N) - matmuls(1)."""
    auto, mm = cost["auto"], cost["matmuls"]
    return {n: round(1 + (mm[n] - mm["1"]) / auto["1"], 2) for n in auto if n in mm}
