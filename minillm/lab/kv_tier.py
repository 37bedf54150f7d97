"""Chapter 8 (running the server): the host KV tier measured on a multi-turn chat workload.

`multi_turn(model, tokenizer, ...)` serves `users` conversations that share one long system
prompt (the tokenizer's real chat template), `turns` rounds of one question each, and between
rounds a long unrelated prompt (other traffic) that pushes every cached block out of a device
pool too small to keep them. It runs the same workload with the tier off and on and returns a
plain dict: prefix hit rates (device hits, host hits, of the blocks prompts could reuse), the
prompt tokens really computed, TTFT per turn, the restore cost per block against the recompute
cost per block (measured prefill of the same number of tokens, and the roofline's estimate for
this machine's measured ceilings: minillm.lab.measure), and whether the outputs were identical.

`block_costs(model, ...)` is the cost part alone: restore (host -> device copies, per block,
through the runner's `HostKVPool`) and recompute (an engine prefill of the same tokens), timed in
interleaved rounds, each a median. On CUDA the host pool is pinned and the restore is a DMA over
the host link; on a CPU both "tiers" are the same DRAM, so a restore is a memcpy.

Left out on purpose: arrival processes and think times (a round's users arrive together; the
idle path is covered by the tests on a fake clock), and output quality (the outputs are compared
token for token with the tier off, which is stronger).
"""
import os
import random
import statistics
import time

import torch

from minillm.analysis.roofline import dtype_name, prefill_costs, step_time
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.sampling_params import SamplingParams
from minillm.lab.common import sync
from minillm.lab.measure import measure_hardware
from minillm.model.chat import encode_chat
from minillm.paging.host_pool import HostKVPool
from minillm.paging.paged_cache import PagedKVCache

SYSTEM_PROMPT = (
    "You are the help desk assistant of a small public library. Answer in at most three short "
    "sentences, politely and plainly. Rules you always follow: (1) Opening hours are Monday to "
    "Friday 9:00 to 19:00 and Saturday 10:00 to 16:00; the library is closed on Sundays and public "
    "holidays. (2) A library card is free for residents; visitors pay five euros a year. (3) Books "
    "are lent for three weeks and can be renewed twice online unless someone reserved them. (4) "
    "Late returns cost twenty cents per book per day, at most five euros per book. (5) DVDs are "
    "lent for one week and cannot be renewed. (6) The reading room is silent; phone calls are "
    "allowed in the hall only. (7) Printing costs ten cents per page in black and white and fifty "
    "cents in colour. (8) Wi-Fi is free; the password is printed on the back of every card. (9) "
    "Children under twelve must be accompanied by an adult after 17:00. (10) Lost cards are "
    "replaced for two euros. (11) Room bookings for groups are made at the front desk at least "
    "two days ahead. (12) Never invent a rule: if a question is not covered, say you do not know "
    "and suggest asking at the front desk.")
QUESTIONS = ["When are you open on Saturday?", "How long can I keep a book?",
             "What does it cost to print ten colour pages?", "Can I renew a DVD?",
             "I lost my card. What now?", "Is the Wi-Fi free?", "Can my child stay at 18:00?",
             "How do I book a room for my club?", "What if I return a book late?"]


def _engine(model, tokenizer, tier_gib, num_blocks: int, block_size: int, idle_s: float):
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True,
                       kv_offloading_size=tier_gib, offload_idle_s=idle_s,
                       max_num_batched_tokens=256, max_num_seqs=8)
    return LLMEngine(model, cfg, tokenizer=tokenizer)


def _serve(engine, tokenizer, system_prompt: str, users: int, turns: int, max_tokens: int,
           other_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    chats = [[{"role": "system", "content": system_prompt}] for _ in range(users)]
    ttft, computed, outputs, t0 = [], [], [], time.perf_counter()
    for turn in range(turns):
        for u, msgs in enumerate(chats):
            msgs.append({"role": "user", "content": QUESTIONS[(turn * users + u) % len(QUESTIONS)]})
        rids = [engine.add_request(encode_chat(tokenizer, m), params) for m in chats]
        while any(not engine.requests[r].finished for r in rids):
            engine.step()
        ttft.append([engine.requests[r].metrics.ttft for r in rids])
        computed.append(sum(len(engine.requests[r].prompt_token_ids)
                            - engine.requests[r].metrics.num_cached_tokens for r in rids))
        for r, msgs in zip(rids, chats):
            ids = engine.requests[r].seqs[0].output_token_ids
            outputs.append(ids)
            msgs.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        other = [rng.randrange(tokenizer.vocab_size) for _ in range(other_tokens)]
        engine.generate([other], SamplingParams(max_tokens=1))   # other traffic evicts the chats
    bm, tier = engine.block_manager, engine.block_manager.host_tier
    queried = bm.stats["queried_blocks"]
    host_hits = tier.stats["restored_blocks"] if tier else 0
    prompts = [r for r in engine.requests.values()]
    return {"ttft_s": ttft, "ttft_mean_by_turn_s": [statistics.fmean(t) for t in ttft],
            "computed_prompt_tokens_by_turn": computed,      # what TTFT pays for; not timed
            "queried_blocks": queried, "device_hit_blocks": bm.stats["hit_blocks"],
            "host_hit_blocks": host_hits, "device_hit_rate": bm.stats["hit_blocks"] / max(queried, 1),
            "host_hit_rate": host_hits / max(queried, 1),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in prompts),
            "computed_prompt_tokens": sum(len(r.prompt_token_ids) - r.metrics.num_cached_tokens
                                          for r in prompts),
            "tier": dict(tier.stats) if tier else None, "outputs": outputs,
            "wall_s": time.perf_counter() - t0}


def block_costs(model, block_size: int = 16, num_blocks: int = 16, rounds: int = 5,
                hardware=None) -> dict:
    """Seconds per block: restoring `num_blocks` blocks from the host tier against recomputing
    their `num_blocks * block_size` tokens (an engine prefill), in `rounds` interleaved rounds
    (medians; a round's restore is the best of 3, as it has no state to warm); beside them the
    roofline's estimates for `hardware` (measured here when None)."""
    param = next(model.parameters())
    cache = PagedKVCache(model.config, num_blocks, block_size, param.device, param.dtype)
    host = HostKVPool(cache, num_blocks)
    pairs = [(i, i) for i in range(num_blocks)]
    host.store(cache, pairs)
    eng = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=num_blocks + 1,
                                        max_num_batched_tokens=256))
    ids = [random.Random(0).randrange(model.config.vocab_size) for _ in range(num_blocks * block_size)]
    restore, recompute = [], []
    eng.generate([ids], SamplingParams(max_tokens=1))        # warm-up, both paths
    host.restore(cache, pairs)

    def timed(fn) -> float:
        sync(param.device)
        t = time.perf_counter()
        fn()
        sync(param.device)
        return (time.perf_counter() - t) / num_blocks
    for _ in range(rounds):
        restore.append(min(timed(lambda: host.restore(cache, pairs)) for _ in range(3)))
        recompute.append(timed(lambda: eng.generate([ids], SamplingParams(max_tokens=1))))
    per_block = PagedKVCache.bytes_per_block(model.config, block_size, param.dtype)
    dtype = dtype_name(param.dtype)
    hw = hardware or measure_hardware(param.device, quick=True, dtypes=(dtype,), progress=False)
    roof_recompute = step_time(prefill_costs(model.config, num_blocks * block_size, dtype=dtype),
                               hw, dtype) / num_blocks
    # a memcpy reads and writes each byte; a GPU restore crosses the host link instead (measured)
    roof_restore = 2 * per_block / hw.mem_bandwidth if param.device.type == "cpu" else None
    restore_s, recompute_s = statistics.median(restore), statistics.median(recompute)
    return {"device": param.device.type, "pinned": host.pinned, "bytes_per_block": per_block,
            "num_blocks": num_blocks, "block_size": block_size, "restore_s_per_block": restore_s,
            "recompute_s_per_block": recompute_s, "restore_gb_per_s": per_block / restore_s / 1e9,
            "recompute_over_restore": recompute_s / restore_s,
            "roofline_recompute_s_per_block": roof_recompute,
            "roofline_restore_s_per_block": roof_restore, "hardware": hw.name,
            "mem_bandwidth": hw.mem_bandwidth, "peak_flops": hw.peak(dtype),
            "rounds": {"restore": restore, "recompute": recompute}}


def multi_turn(model, tokenizer, users: int = 1, turns: int = 2, max_tokens: int = 6,
               block_size: int = 16, kv_offloading_size: float = 0.25,
               offload_idle_s: float = 2.0, system_prompt: str = SYSTEM_PROMPT, seed: int = 0,
               costs: bool = True, cost_blocks: int = 16, cost_rounds: int = 3,
               repeats: int = 1) -> dict:
    """The workload with the tier off and on (see the module docstring); a plain dict. The
    defaults take about a minute on 2 busy cores (load average 6-8) with SmolLM2-135M; the
    benchmark (benchmarks/kv_tier.py) runs 3 users x 3 turns, 3 times. The
    device pool holds one round of conversations with a little slack; the other traffic after
    each round is a prompt as long as the whole pool, so nothing cached survives it on the
    device. `costs=False` skips `block_costs` (and its roofline measurement). `repeats` > 1
    runs the pair again, in alternating order, and reports each turn's mean TTFT from the try
    that was least disturbed (the smallest: on a shared machine other processes only ever add
    time; every try is kept in `ttft_mean_by_turn_s_tries`). The hit counts are the same in
    every try; how many copies the idle path made depends on time."""
    system = len(encode_chat(tokenizer, [{"role": "system", "content": system_prompt}]))
    num_blocks = -(-system // block_size) + users * (-(-turns * 40 // block_size) + 1)
    other_tokens = (num_blocks - 1) * block_size
    tries = {"off": [], "on": []}
    for r in range(repeats):       # interleaved: off, on, then on, off, ... (the load drifts)
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            eng = _engine(model, tokenizer, kv_offloading_size if name == "on" else None,
                          num_blocks, block_size, offload_idle_s)
            tries[name].append(_serve(eng, tokenizer, system_prompt, users, turns, max_tokens,
                                      other_tokens, seed))
    runs = {name: {**t[0], "ttft_mean_by_turn_s": [min(x) for x in
                                                   zip(*(r["ttft_mean_by_turn_s"] for r in t))],
                   "ttft_mean_by_turn_s_tries": [r["ttft_mean_by_turn_s"] for r in t]}
            for name, t in tries.items()}
    off, on = runs["off"], runs["on"]
    return {"settings": {"users": users, "turns": turns, "max_tokens": max_tokens,
                         "block_size": block_size, "num_blocks": num_blocks,
                         "system_prompt_tokens": system, "other_tokens": other_tokens,
                         "kv_offloading_size": kv_offloading_size,
                         "offload_idle_s": offload_idle_s, "seed": seed, "repeats": repeats},
            "runs": runs, "identical": all(t["outputs"] == off["outputs"]
                                           for t in tries["off"] + tries["on"]),
            "costs": block_costs(model, block_size, cost_blocks, cost_rounds) if costs else None,
            "ttft_off_over_on_by_turn": [a / b for a, b in zip(off["ttft_mean_by_turn_s"],
                                                               on["ttft_mean_by_turn_s"])],
            "torch_threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
