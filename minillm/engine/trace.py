"""What the engine records as it runs: one trace row per step (the chapters' Gantt charts,
occupancy plots and step budgets are drawn from these rows), how much of it it keeps, and the
progress bar of `generate`, and the export of it all as JSON."""
import json
from dataclasses import asdict


def trace_row(step: int, out, t0: float, t1: float, num_decode: int, prefill_ids: list[str],
              scheduler, block_manager) -> dict:
    """One step: when it ran, its decode and prefill tokens, the queues after it, blocks in use."""
    s = scheduler
    return {
        "step": step, "t_start": t0, "t_end": t1,
        "num_decode_tokens": int(num_decode), "num_prefill_tokens": out.num_tokens - int(num_decode),
        "num_seqs": len(out.scheduled), "num_running": len(s.running),
        "num_waiting": len(s.waiting), "num_swapped": len(s.swapped),
        "blocks_used": block_manager.num_used_blocks, "num_preempted": len(out.preempted),
        "request_ids": [seq.request_id for seq, _ in out.scheduled],
        "padding_request_ids": list(out.padding),
        "prefill_request_ids": prefill_ids}


def progress_bar(total: int):
    """A tqdm bar of finished requests, or None when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests")


def prune(trace: list, requests: dict, forgotten, pinned, config, num_unfinished: int) -> None:
    """Bounded memory for a long-running engine: keep the newest `config.retain_finished`
    finished requests (those a running `generate` call still has to return are kept too) and the
    newest `config.max_trace_steps` trace rows. Dropped ids go to `forgotten` (an OrderedDict,
    itself bounded) so that aborting one later is a no-op, not an error."""
    if len(trace) > config.max_trace_steps:
        del trace[:len(trace) - config.max_trace_steps]
    extra = len(requests) - config.retain_finished - num_unfinished
    if extra <= 0:
        return
    for rid in [r for r, req in requests.items() if req.finished and r not in pinned][:extra]:
        del requests[rid]
        forgotten[rid] = None
    while len(forgotten) > 16 * config.retain_finished:
        forgotten.popitem(last=False)


def export_trace(config, num_blocks: int, trace: list, requests: dict, path=None) -> dict:
    """An engine's per-step trace and per-request metrics as a JSON-ready dict (written to `path`
    if given): `LLMEngine.export_trace`."""
    data = {"config": asdict(config), "num_blocks": num_blocks, "steps": trace,
            "requests": {rid: r.metrics.as_dict() for rid, r in requests.items()}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    return data
