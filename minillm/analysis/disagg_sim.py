"""Chapter 11: a small discrete-event simulator of colocated and disaggregated serving.

Letters: L prompt tokens, S tokens cached, B sequences in a step.

Requests (`SimRequest`: arrival, prompt tokens, output tokens) arrive at engines whose steps cost
what `StepCosts` says; events (arrival, step end, KV transfer end) sit in a heap. Each engine
schedules as engine/scheduler.py does with chunked prefill (decodes first, then waiting prompts
within `max_num_seqs`, `max_num_batched_tokens`, `long_prefill_token_threshold` and the
partial-prefill limits); `SimConfig()` holds the server's defaults (serve/cli.py).
- `simulate_colocated`: each instance prefills and decodes (the prefill stall included);
- `simulate_disaggregated`: prefill instances emit the first token, the KV crosses a link
  (serialized per prefill instance; `transfer_blocks_prefill`: the prefill engine sends it
  itself) into a decode instance, which takes it at its next step when a seat is free.
A new request goes to the instance with the least work queued.

Left out on purpose: KV memory limits and preemption (pools are taken as large enough), EOS
(every request produces exactly its output tokens), HTTP and detokenizing time, and speculative
decoding.
"""
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from minillm._validate import check_int, check_real
from minillm.analysis.kv_math import kv_cache_bytes
from minillm.analysis.parallel_math import Link, get_link
from minillm.analysis.step_fit import StepCosts


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self):
        check_real("SimRequest.arrival_s", self.arrival_s, 0)
        check_int("SimRequest.prompt_tokens", self.prompt_tokens, 1)
        check_int("SimRequest.output_tokens", self.output_tokens, 1)


@dataclass
class SimResult:
    request: SimRequest
    token_times: list[float] = field(default_factory=list)   # absolute s of each output token
    prefill_done_s: float = math.nan
    transfer_done_s: float = math.nan                         # nan when colocated

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.request.arrival_s

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def finish_s(self) -> float:
        return self.token_times[-1]


@dataclass(frozen=True)
class SimConfig:
    """Scheduler knobs of one simulated engine (vLLM's names; defaults: minillm's server)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    long_prefill_token_threshold: int = 384
    max_num_partial_prefills: int = 2
    max_long_partial_prefills: int = 1

    def __post_init__(self):
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1, self.max_num_batched_tokens)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        check_int("max_num_partial_prefills", self.max_num_partial_prefills, 1)
        check_int("max_long_partial_prefills", self.max_long_partial_prefills, 1,
                  self.max_num_partial_prefills)


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """n arrival times: 0, then exponential gaps of mean 1/rate (the same draws as the load
    generator's `arrival_times(n, rate, burstiness=1, seed)`, so a simulation and a measured
    run see the same arrivals)."""
    check_real("rate", rate, 0, low_open=True)
    check_int("n", n, 1)
    rng, t, out = random.Random(seed), 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.gammavariate(1.0, 1.0 / rate)
        out.append(t)
    return out


def kv_transfer_time(cfg, prompt_tokens: int, link, dtype="bf16") -> float:
    """Seconds to ship a prompt's KV cache: latency + bytes / bandwidth. `link`: bytes/s, a
    `parallel_math.Link` or its preset name ("10gbe", "400gbe", "nvlink4", ...)."""
    nbytes = kv_cache_bytes(cfg, prompt_tokens, 1, dtype)
    if isinstance(link, (int, float)) and not isinstance(link, bool):
        return nbytes / check_real("link", link, 0, low_open=True)
    if not isinstance(link, (str, Link)):
        raise TypeError(f"link must be bytes/s, a Link or a preset name, got {link!r}")
    link = get_link(link)
    return link.latency_s + nbytes / link.bandwidth_Bps


class _Seq:
    __slots__ = ("i", "req", "computed", "first_step", "result")

    def __init__(self, i: int, req: SimRequest, result: SimResult):
        self.i, self.req, self.result = i, req, result
        self.computed, self.first_step = 0, 0

    @property
    def need(self) -> int:                      # prompt tokens still to compute
        return self.req.prompt_tokens - self.computed


class _Engine:
    """One engine: its queues, the scheduler's decision, a step's effect.

    Every running sequence past its prompt decodes in every step (decodes go first and the
    budget covers max_num_seqs of them, as EngineConfig requires), so a decoding sequence is
    only counted (`num_dec`, `ctx_sum`); its token times are the engine's step ends (`ends`)
    from its first decode step on, read when it finishes (`finishing`: step -> sequences)."""

    def __init__(self, costs: StepCosts, cfg: SimConfig, role: str):
        self.costs, self.cfg, self.role = costs, cfg, role   # role: colocated | prefill | decode
        self.waiting: deque[_Seq] = deque()   # prompts not yet admitted (or KV not yet taken in)
        self.prefilling: list[_Seq] = []      # admitted, prompt not done, arrival order
        self.num_dec, self.ctx_sum, self.queued = 0, 0, 0   # decoding seqs, their context, tokens
        self.ends: list[float] = []           # end time of each step
        self.finishing: dict[int, list[_Seq]] = {}
        self.busy, self.step_plan = False, ([], 0)

    def add(self, s: _Seq) -> None:
        self.waiting.append(s)
        self.queued += s.need if self.role != "decode" else 1

    def load(self) -> int:
        return self.queued + sum(s.need for s in self.prefilling) if self.role != "decode" \
            else self.num_dec + len(self.waiting)

    def _size(self, need: int, budget: int) -> int:
        return min(need, budget, self.cfg.long_prefill_token_threshold or need)

    def _is_long(self, need: int) -> bool:
        return 0 < self.cfg.long_prefill_token_threshold < need

    def _start_decoding(self, s: _Seq, step: int) -> None:
        """s decodes from `step` on: its context then is its prompt (+ the first token, not yet
        cached), and its last token comes output_tokens - 1 steps later."""
        s.first_step = step
        self.num_dec += 1
        self.ctx_sum += s.req.prompt_tokens
        self.finishing.setdefault(step + s.req.output_tokens - 2, []).append(s)

    def schedule(self) -> tuple[list, int]:
        """(chunks [(seq, n)], decodes) of the next step, as Scheduler.schedule decides."""
        cfg, partial = self.cfg, [0, 0]
        if self.role == "decode":              # imported KV joins while seats allow
            while self.waiting and self.num_dec < cfg.max_num_seqs:
                self.queued -= 1
                self._start_decoding(self.waiting.popleft(), len(self.ends))
        budget, chunks = cfg.max_num_batched_tokens - self.num_dec, []
        for s in self.prefilling:
            n = self._size(s.need, budget)
            if n < s.need and s.need > 1:
                partial[0] += 1
                partial[1] += self._is_long(s.need)
            if n:
                chunks.append((s, n))
                budget -= n
        passed = []
        while self.role != "decode" and self.waiting and budget > 0:
            s = self.waiting[0]
            if len(self.prefilling) + self.num_dec + 1 > cfg.max_num_seqs:
                break
            n = self._size(s.need, budget)
            if n < s.need and (partial[0] >= cfg.max_num_partial_prefills or (
                    self._is_long(s.need) and partial[1] >= cfg.max_long_partial_prefills)):
                passed.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.queued -= s.need
            self.prefilling.append(s)
            chunks.append((s, n))
            if n < s.need:
                partial[0] += 1
                partial[1] += self._is_long(s.need)
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return chunks, self.num_dec

    def seconds(self, chunks, num_decodes: int) -> float:
        return self.costs.mixed_seconds(sum(n for _, n in chunks),
                                        sum(n * (s.computed + n) for s, n in chunks),
                                        num_decodes, self.ctx_sum)

    def apply(self, chunks, num_decodes: int, now: float) -> tuple[list, list]:
        """Advance the step's sequences; -> (prompts finished here, requests finished here)."""
        step = len(self.ends)
        self.ends.append(now)
        self.ctx_sum += num_decodes                        # each decode cached one more token
        done = self.finishing.pop(step, [])
        for s in done:
            self.num_dec -= 1
            self.ctx_sum -= s.req.prompt_tokens + s.req.output_tokens - 1
            s.result.token_times.extend(self.ends[s.first_step:step + 1])
        prefilled = []
        for s, n in chunks:
            s.computed += n
            if s.need == 0:
                self.prefilling.remove(s)
                s.result.token_times.append(now)
                s.result.prefill_done_s = now
                prefilled.append(s)
                if s.req.output_tokens == 1:
                    done.append(s)
                elif self.role == "colocated":
                    self._start_decoding(s, step + 1)
        return prefilled, done


def _check_requests(requests) -> list[SimRequest]:
    requests = list(requests)
    if not requests:
        raise ValueError("requests must hold at least one SimRequest")
    for i, r in enumerate(requests):
        if not isinstance(r, SimRequest):
            raise TypeError(f"requests[{i}] must be a SimRequest, got {type(r).__name__}")
    return requests


def _check_costs(name: str, costs) -> StepCosts:
    if not isinstance(costs, StepCosts):
        raise TypeError(f"{name} must be a StepCosts, got {type(costs).__name__}")
    return costs


def _transfer_fn(transfer_s):
    if callable(transfer_s):
        return transfer_s
    check_real("transfer_s", transfer_s, 0)
    return lambda prompt_tokens: float(transfer_s)


def _simulate(requests, front: list[_Engine], back: list[_Engine], transfer, blocking: bool,
              trace: list | None):
    """Run the events to the end; `back` empty: colocated. -> results in request order."""
    results = [SimResult(r) for r in requests]
    heap, order = [], 0

    def push(t: float, kind: str, data) -> None:
        nonlocal order
        heapq.heappush(heap, (t, order, kind, data))
        order += 1

    for i, r in enumerate(requests):
        push(r.arrival_s, "arrive", _Seq(i, r, results[i]))
    link_free = {id(e): 0.0 for e in front}
    while heap:
        now = heap[0][0]
        while heap and heap[0][0] == now:
            _, _, kind, data = heapq.heappop(heap)
            if kind == "arrive":
                min(front, key=_Engine.load).add(data)
            elif kind == "kv":
                data.result.transfer_done_s = now
                min(back, key=_Engine.load).add(data)
            elif kind == "free":
                data.busy = False
            else:                                   # "step": an engine's step ended
                prefilled, done = data.apply(*data.step_plan, now)
                data.busy = False
                for s in (prefilled if back else ()):
                    if s.req.output_tokens == 1:
                        continue                    # a one-token answer needs no decode side
                    start = max(now, link_free[id(data)])
                    link_free[id(data)] = start + transfer(s.req.prompt_tokens)
                    push(link_free[id(data)], "kv", s)
                if blocking and data.role == "prefill" and link_free[id(data)] > now:
                    data.busy = True                # the engine sends the KV itself
                    push(link_free[id(data)], "free", data)
        for k, eng in enumerate((*front, *back)):
            if not eng.busy:
                chunks, decodes = eng.schedule()
                if chunks or decodes:
                    eng.busy, eng.step_plan = True, (chunks, decodes)
                    end = now + eng.seconds(chunks, decodes)
                    push(end, "step", eng)
                    if trace is not None:
                        trace.append({"engine": k, "role": eng.role, "t_start": now, "t_end": end,
                                      "num_prefill_tokens": sum(n for _, n in chunks),
                                      "num_decode_tokens": decodes})
    return results


def simulate_colocated(requests, costs: StepCosts, config: SimConfig | None = None,
                       instances: int = 1, trace: list | None = None) -> list[SimResult]:
    """Each of `instances` engines prefills and decodes its requests; -> one SimResult per
    request, in the order given. `trace`: a list that gets one row per step (engine index,
    role, t_start, t_end, num_prefill_tokens, num_decode_tokens: the engine trace's names)."""
    requests = _check_requests(requests)
    _check_costs("costs", costs)
    check_int("instances", instances, 1)
    config = config or SimConfig()
    return _simulate(requests, [_Engine(costs, config, "colocated") for _ in range(instances)],
                     [], None, False, trace)


def simulate_disaggregated(requests, prefill_costs: StepCosts, decode_costs: StepCosts,
                           transfer_s=0.0, config: SimConfig | None = None,
                           decode_config: SimConfig | None = None, prefill_instances: int = 1,
                           decode_instances: int = 1,
                           transfer_blocks_prefill: bool = False,
                           trace: list | None = None) -> list[SimResult]:
    """Prefill engines, a KV transfer of `transfer_s` seconds (a number, or a function of the
    prompt's tokens, e.g. `lambda L: kv_transfer_time(cfg, L, link)`), decode engines.
    `config`: the prefill engines' knobs; `decode_config`: the decode engines' (default: config);
    `trace` as in `simulate_colocated` (engines 0.. are the prefill ones, then the decode ones)."""
    requests = _check_requests(requests)
    _check_costs("prefill_costs", prefill_costs)
    _check_costs("decode_costs", decode_costs)
    check_int("prefill_instances", prefill_instances, 1)
    check_int("decode_instances", decode_instances, 1)
    if not isinstance(transfer_blocks_prefill, bool):
        raise TypeError(f"transfer_blocks_prefill must be a bool, got {transfer_blocks_prefill!r}")
    config = config or SimConfig()
    front = [_Engine(prefill_costs, config, "prefill") for _ in range(prefill_instances)]
    back = [_Engine(decode_costs, decode_config or config, "decode") for _ in range(decode_instances)]
    return _simulate(requests, front, back, _transfer_fn(transfer_s), transfer_blocks_prefill, trace)
