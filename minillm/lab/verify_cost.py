"""What a verify step costs: one forward over N new tokens against one over 1 token (chapters 1, 6).

Letters: N new tokens of the forward, S cached context, L layers, H/Hkv heads, D head dim.

`verify_table` measures forward(N) / forward(1) on this machine after a cached context, beside:
- the roofline's prediction (`roofline_ratio`, each op at its own roofline): near 1 below the
  ridge point in rows (`ridge_rows`), about linear in N above it;
- the least these matmul kernels allow (`forward_cost.least_forward_ratio`): forward(1) plus the
  matmuls' growth from 1 row to N, over forward(1);
- where the rest goes: "other" (the forward minus its matmuls), `attention_alone` (each layer's
  cache write and SDPA at N queries) and "least_with_attention".
`int8=True` adds the same matmuls through torch's int8 dynamic quantized linear (`int8_matmuls`)
and that route's least ratio. Cases are timed in interleaved rounds, each keeping its fastest.

Left out on purpose: tree-shaped masks (a tree's N rows cost what a chain's N rows cost here)
and batches of more than one sequence.
"""
import time
import warnings

import torch
import torch.nn.functional as F

from minillm._validate import check_int, check_real
from minillm.analysis.roofline import (Hardware, _first_reaching, dtype_name, step_costs, step_time,
                                      total_cost)
from minillm.kernels.cpu_kernels import linear_route
from minillm.lab.common import prefilled
from minillm.lab.measure import decode_matmuls, measure_hardware

VERIFY_ROWS = (1, 2, 4, 9, 17, 33, 64)
TOLERANCE = 0.15            # the target: forward(N) / forward(1) within 15% of the least


def _verify_costs(cfg, n: int, context: int, dtype):
    """The ops of one verify forward: 1 sequence, N new tokens, logits at all N positions."""
    return step_costs(cfg, 1, n, context, dtype, logits_tokens=n)


def ridge_rows(cfg, hardware: Hardware, dtype="fp32", context: int = 128,
               max_rows: int = 1 << 16) -> int | None:
    """Smallest N whose verify forward (logits at every position, `context` cached) reaches the
    ridge point of `hardware` in total intensity: below it the forward is memory-bound and N
    rows cost about what 1 row costs; above it the cost grows about linearly with N. For fp32
    matmuls alone that is near ridge * 4 / 2 rows (2 FLOPs per weight element per row, 4 bytes
    per element). None if even `max_rows` stays below the ridge."""
    check_int("context", context, 0)
    check_int("max_rows", max_rows, 1)
    ridge = hardware.ridge(dtype)

    return _first_reaching(lambda n: total_cost(_verify_costs(cfg, n, context, dtype)).intensity,
                           ridge, max_rows)


def roofline_ratio(cfg, hardware: Hardware, n: int, dtype="fp32", context: int = 128) -> float:
    """The roofline's forward(N) / forward(1): each op of the verify forward at its own
    roofline (`step_time`), N new tokens against 1."""
    check_int("n", n, 1)
    check_int("context", context, 0)
    one = step_time(_verify_costs(cfg, 1, context, dtype), hardware, dtype)
    return step_time(_verify_costs(cfg, n, context, dtype), hardware, dtype) / one


def attention_alone(model, n: int, context: int = 128, seed: int = 0):
    """A function that runs the attention of one N-token forward after `context` cached tokens
    and nothing else: per layer, the cache write (`index_copy_`), the causal mask and SDPA of N
    queries against the context + N keys, on tensors shaped as the model's."""
    check_int("n", n, 1)
    check_int("context", context, 0)
    cfg, dev, dt = model.config, model.device, model.dtype
    H, Hkv, D, L = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_layer
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, Hkv, context + n, D, generator=g).to(dev, dt) for _ in range(L)]
    vals = [torch.randn(1, Hkv, context + n, D, generator=g).to(dev, dt) for _ in range(L)]
    q = torch.randn(1, H, n, D, generator=g).to(dev, dt)                   # (1, H, N, D)
    new = torch.randn(1, Hkv, n, D, generator=g).to(dev, dt)               # (1, Hkv, N, D)
    pos = torch.arange(context, context + n, device=dev)                   # (N,)
    slots = torch.arange(context + n, device=dev)                          # (S + N,)

    @torch.inference_mode()
    def run():
        for k, v in zip(keys, vals):
            k.index_copy_(2, pos, new)
            v.index_copy_(2, pos, new)
            mask = None if n == 1 else slots <= pos[:, None]               # (N, S + N)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hkv != H)
    return run


def int8_prepack(model) -> list | None:
    """Every `nn.Linear` weight of `model`, quantized to int8 per output channel (symmetric) and
    prepacked for torch's `quantized::linear_dynamic`, as (in_features, packed) in module order;
    None where this torch has no quantized engine or the model is not on a CPU."""
    if model.device.type != "cpu" or torch.backends.quantized.engine == "none":
        return None
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight.detach().float()
            scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)          # (out,)
            with warnings.catch_warnings():       # torch marks its quantized tensors deprecated
                warnings.simplefilter("ignore", UserWarning)
                qw = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long),
                                                0, torch.qint8)
            out.append((m.in_features, torch.ops.quantized.linear_prepack(qw, None)))
    return out


def int8_matmuls(model, n: int, seed: int = 0, packed: list | None = None):
    """A function that runs a forward's matmuls (every `nn.Linear` of `model`, once) at N rows
    through torch's int8 dynamic quantized linear (W8A8: `int8_prepack`'s weights, activations
    quantized per call), or None where this torch has no such kernel. `packed`: an
    `int8_prepack(model)` to share between row counts."""
    check_int("n", n, 1)
    packed = packed if packed is not None else int8_prepack(model)
    if packed is None:
        return None
    g = torch.Generator().manual_seed(seed)
    xs = {k: torch.randn(n, k, generator=g) for k in sorted({k for k, _ in packed})}  # (N, in)
    calls = [(xs[k], p) for k, p in packed]

    @torch.inference_mode()
    def run():
        for x, p in calls:
            torch.ops.quantized.linear_dynamic(x, p, True)                 # (N, out)
    return run


@torch.inference_mode()
def verify_table(model, rows=VERIFY_ROWS, context: int = 128, rounds: int = 5,
                 hardware: Hardware | None = None, tolerance: float = TOLERANCE,
                 attention: bool = True, int8: bool = False) -> dict:
    """The verify-cost table of `model` on this machine: per N in `rows` (1 included), the ms of
    one forward over N new tokens after `context` cached ones (each case's fastest of `rounds`
    interleaved rounds), its ratio to N = 1, the least ratio these kernels allow, the roofline's
    ratio for `hardware` (measured here when None) and the gap ratio / least - 1, flagged
    within `tolerance` or not.

    Returns {"rows": [{"n", "forward_ms", "matmuls_ms", "other_ms", "ratio", "least",
    "roofline", "gap", "within", and with `attention` "attention_ms" and "least_with_attention"
    (the least when the attention's growth, timed alone, also counts as unavoidable), with `int8`
    "int8_matmuls_ms", "int8_least"}...], "ridge_rows", "tolerance", "context", "dtype",
    "hardware", "within_all", "limit", "noise"}. "noise" is the largest relative gap between a
    case's fastest and second-fastest round (0 with one round): how far a fastest round may sit
    above the undisturbed time, so a ratio of two of them is known to about (1 + noise)^2.
    "limit" names what most of the largest N's excess over the least is: "attention" or "other
    non-matmul work" (norms, elementwise ops, copies), or None when every row is within tolerance.
    """
    rows = tuple(rows)
    if not rows:
        raise ValueError("rows must be a non-empty sequence of ints >= 1")
    for i, n in enumerate(rows):
        check_int(f"rows[{i}]", n, 1)
    rows = tuple(sorted(set(rows) | {1}))
    check_int("context", context, 1)
    check_int("rounds", rounds, 1)
    check_real("tolerance", tolerance, 0.0, 10.0, low_open=True)
    dtype = dtype_name(model.dtype)
    if hardware is None:
        hardware = measure_hardware(model.device, dtypes=(dtype,), progress=False)
    _, forward = prefilled(model, 1, context, max(rows))
    xs = {n: torch.ones(1, n, dtype=torch.long, device=model.device) for n in rows}
    cases = {"forward": {n: (lambda x=xs[n]: forward(x)) for n in rows},
             "matmuls": {n: decode_matmuls(model, n) for n in rows}}
    if attention:
        cases["attention"] = {n: attention_alone(model, n, context) for n in rows}
    packed = int8_prepack(model) if int8 else None
    if packed is not None:
        cases["int8_matmuls"] = {n: int8_matmuls(model, n, packed=packed) for n in rows}
    samples = {(c, n): [] for c in cases for n in rows}
    with linear_route("auto"):
        for c in cases:                                                    # warm-up
            for n in rows:
                cases[c][n]()
        for _ in range(rounds):
            for (c, n), times in samples.items():
                t0 = time.perf_counter()
                cases[c][n]()
                times.append(1e3 * (time.perf_counter() - t0))
    ms = {c: {n: min(samples[(c, n)]) for n in rows} for c in cases}
    noise = max((sorted(t)[1] / sorted(t)[0] - 1 if len(t) > 1 else 0.0)
                for t in samples.values())
    f1, m1 = ms["forward"][1], ms["matmuls"][1]
    other1 = max(f1 - m1, 0.0)
    table = []
    for n in rows:
        f, m = ms["forward"][n], ms["matmuls"][n]
        ratio, least = f / f1, 1 + (m - m1) / f1
        row = {"n": n, "forward_ms": round(f, 3), "matmuls_ms": round(m, 3),
               "other_ms": round(f - m, 3), "ratio": round(ratio, 3), "least": round(least, 3),
               "roofline": round(roofline_ratio(model.config, hardware, n, dtype, context), 3),
               "gap": round(ratio / least - 1, 3), "within": ratio <= least * (1 + tolerance)}
        if attention:
            a, a1 = ms["attention"][n], ms["attention"][1]
            row["attention_ms"] = round(a, 3)
            row["least_with_attention"] = round(least + (a - a1) / f1, 3)
        if "int8_matmuls" in ms:
            q, q1 = ms["int8_matmuls"][n], ms["int8_matmuls"][1]
            row["int8_matmuls_ms"] = round(q, 3)
            row["int8_least"] = round((other1 + q) / (other1 + q1), 3)
        table.append(row)
    return {"rows": table, "ridge_rows": ridge_rows(model.config, hardware, dtype, context),
            "tolerance": tolerance, "context": context, "dtype": dtype,
            "hardware": {"name": hardware.name, "peak_flops": hardware.peak(dtype),
                         "mem_bandwidth": hardware.mem_bandwidth},
            "within_all": all(r["within"] for r in table), "limit": _limit(table),
            "noise": round(noise, 3)}


def _limit(table: list) -> str | None:
    """What most of the excess over the least is at the largest N off target: the growth of the
    attention timed alone, or of the rest of the non-matmul work."""
    off = [r for r in table if not r["within"]]
    if not off:
        return None
    last, first = off[-1], table[0]
    excess = last["other_ms"] - first["other_ms"]
    if "attention_ms" in last and excess > 0 and \
            last["attention_ms"] - first["attention_ms"] >= excess / 2:
        return "attention"
    return "other non-matmul work"


def format_verify_table(t: dict) -> str:
    """`verify_table`'s result as aligned text: one line per N, then the ridge and the verdict."""
    extra = [k for k in ("attention_ms", "least_with_attention", "int8_least") if k in t["rows"][0]]
    names = {"attention_ms": "attn ms", "least_with_attention": "least+attn", "int8_least": "int8 least"}
    head = ["N", "forward ms", "ratio", "least", "roofline", "gap", "other ms", *map(names.get, extra)]
    lines = ["".join(f"{h:>11}" for h in head)]
    for r in t["rows"]:
        cells = [r["n"], f"{r['forward_ms']:.1f}", f"{r['ratio']:.2f}", f"{r['least']:.2f}",
                 f"{r['roofline']:.2f}", f"{100 * r['gap']:+.0f}%" + ("" if r["within"] else "*"),
                 f"{r['other_ms']:.1f}"]
        cells += [f"{r[k]:.1f}" if k.endswith("_ms") else f"{r[k]:.2f}" for k in extra]
        lines.append("".join(f"{c:>11}" for c in cells))
    ridge = t["ridge_rows"]
    lines.append(f"roofline ridge: {ridge if ridge is not None else 'beyond 65536'} rows "
                 f"({t['dtype']}, {t['context']} cached); gap = ratio / least - 1, "
                 f"* beyond {100 * t['tolerance']:.0f}%")
    lines.append("every N within " + f"{100 * t['tolerance']:.0f}% of the least" if t["within_all"]
                 else f"not within {100 * t['tolerance']:.0f}% of the least at every N: "
                      f"limited by {t['limit']}")
    return "\n".join(lines)
