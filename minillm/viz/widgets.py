"""Interactive panels for chapters 1-2 (ipywidgets), each with a static twin.

`roofline_panel()` picks hardware, model, dtype, batch and context and redraws the roofline with
that decode step (and the prefill of the same context) on it. `kv_panel()` picks model, dtype,
context, batch and KV heads and redraws weights vs KV memory. Each panel is displayed with a
static figure of its starting values below it, so a notebook rendered without a widget
frontend (nbval, GitHub, nbconvert) still shows a plot and the same summary text.

Letters: B batch, S context, Hkv KV heads.
Left out on purpose: callbacks beyond redraw; the panels compute nothing the modules don't.
"""
import matplotlib.pyplot as plt

from minillm.model.config import PRESETS, get_config
from minillm.analysis.kv_math import kv_bytes_per_token, kv_cache_bytes, weight_bytes
from minillm.viz.roofline import plot_memory_vs_context, plot_roofline
from minillm.analysis.roofline import (HARDWARE_PRESETS, Hardware, decode_compute_bound_batch,
                              decode_costs, get_hardware, prefill_costs, step_time, total_cost)

MEASURED = "this machine (measured)"


def roofline_view(hw: Hardware, model: str, dtype: str, batch: int, context: int):
    """(Figure, summary text) for one decode step of `model` at batch B, context S on `hw`."""
    cfg = get_config(model)
    dec = decode_costs(cfg, batch, context, dtype)
    pre = prefill_costs(cfg, max(context, 1), 1, dtype)
    pts = [(f"decode B={batch} S={context}", total_cost(dec)),
           (f"prefill T={max(context, 1)}", total_cost(pre))]
    fig = plot_roofline(hw, dtype, predicted=pts, title=f"{cfg.name} on {hw.name} ({dtype})")
    t = step_time(dec, hw, dtype)
    star = decode_compute_bound_batch(cfg, hw, context, dtype)
    text = (f"decode: intensity {pts[0][1].intensity:.2f} FLOP/byte (ridge "
            f"{hw.ridge(dtype):.1f}), step >= {t * 1e3:.3f} ms, <= {batch / t:,.0f} tokens/s; "
            f"compute-bound from B = {star if star else 'never (KV reads grow with B)'}")
    return fig, text


def kv_view(model: str, dtype: str, context: int, batch: int, kv_heads: int,
            memory_bytes: float = 80 * 2**30):
    """(Figure, summary text) of weights vs KV memory with `kv_heads` KV heads."""
    cfg = get_config(model).with_(n_kv_head=kv_heads)
    contexts = [2**i for i in range(7, 18) if 2**i <= max(cfg.max_seq_len, context) * 4]
    fig = plot_memory_vs_context(cfg, contexts, batch, dtype, memory_bytes)
    fig.axes[0].axvline(context, color="gray", ls="--", lw=1)
    kv = kv_cache_bytes(cfg, context, batch, dtype)
    text = (f"{cfg.name} Hkv={kv_heads}: {kv_bytes_per_token(cfg, dtype):,.0f} B/token; "
            f"B={batch} x S={context}: KV {kv / 2**30:.2f} GiB, weights "
            f"{weight_bytes(cfg, dtype) / 2**30:.2f} GiB")
    return fig, text


def _show(fig, text):
    from IPython.display import display
    display(fig)
    print(text)
    plt.close(fig)


def _panel(view, controls: dict, static_args: dict):
    """Widgets that redraw view(**values) in an Output; then the static twin of static_args."""
    import ipywidgets as w
    from IPython.display import display
    out = w.Output()

    def redraw(**values):
        with out:
            out.clear_output(wait=True)
            _show(*view(**values))
    ui = w.interactive_output(redraw, controls)
    display(w.VBox([w.HBox(list(controls.values())[:3]), w.HBox(list(controls.values())[3:]),
                    out, ui]))
    _show(*view(**static_args))


def roofline_panel(measured: Hardware | None = None, model="llama-3-8b", hardware="h100-sxm",
                   dtype="bf16", batch=1, context=1024):
    """Hardware / model / dtype / batch / context controls over the roofline (+ static figure)."""
    import ipywidgets as w
    hws = {k: v for k, v in HARDWARE_PRESETS.items()}
    if measured is not None:
        hws[MEASURED] = measured

    def view(hardware, model, dtype, batch, context):
        hw = hws[hardware]
        if dtype not in hw.peak_flops:
            known = [d for d in ("bf16", "fp32") if d in hw.peak_flops]
            dtype = known[0] if known else next(iter(hw.peak_flops))
        return roofline_view(hw, model, dtype, batch, context)
    controls = {
        "hardware": w.Dropdown(options=list(hws), value=hardware, description="hardware"),
        "model": w.Dropdown(options=list(PRESETS), value=model, description="model"),
        "dtype": w.Dropdown(options=["bf16", "fp16", "fp8", "fp32"], value=dtype,
                            description="dtype"),
        "batch": w.SelectionSlider(options=[2**i for i in range(11)], value=batch,
                                   description="batch"),
        "context": w.SelectionSlider(options=[0] + [2**i for i in range(7, 18)], value=context,
                                     description="context"),
    }
    _panel(view, controls, dict(hardware=hardware, model=model, dtype=dtype, batch=batch,
                                context=context))


def kv_panel(model="llama-2-70b", dtype="bf16", context=2048, batch=1, kv_heads=None):
    """Model / dtype / context / batch / KV-heads controls over weights vs KV (+ static)."""
    import ipywidgets as w
    cfg = get_config(model)
    kv_heads = cfg.n_kv_head if kv_heads is None else kv_heads
    divisors = [h for h in range(1, cfg.n_head + 1) if cfg.n_head % h == 0]

    def view(model, dtype, context, batch, kv_heads):
        n_head = get_config(model).n_head
        kv_heads = max(h for h in range(1, n_head + 1) if n_head % h == 0 and h <= kv_heads)
        return kv_view(model, dtype, context, batch, kv_heads)
    controls = {
        "model": w.Dropdown(options=list(PRESETS), value=model, description="model"),
        "dtype": w.Dropdown(options=["fp32", "bf16", "fp8", "int4"], value=dtype,
                            description="dtype"),
        "context": w.SelectionSlider(options=[2**i for i in range(7, 18)], value=context,
                                     description="context"),
        "batch": w.SelectionSlider(options=[2**i for i in range(9)], value=batch,
                                   description="batch"),
        "kv_heads": w.SelectionSlider(options=divisors, value=kv_heads, description="KV heads"),
    }
    _panel(view, controls, dict(model=model, dtype=dtype, context=context, batch=batch,
                                kv_heads=kv_heads))
