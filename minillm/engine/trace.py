"""What the engine records as it runs: one trace row per step (the chapters' Gantt charts,
occupancy plots and step budgets are drawn from these rows) and the progress bar of `generate`."""


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
