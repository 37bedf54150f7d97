"""The scheduler: each step, decide which sequences run and how many of their tokens.

It only decides: it keeps the waiting / running / swapped queues and books blocks in the
`BlockManager`; the runner moves the tensors it asks for and runs the forward pass. One step
(`schedule()`) within `max_num_batched_tokens`: running sequences first, decodes before prefill
chunks, preempting the latest arrival when the pool is empty (recompute or swap); then swapped
sequences come back; then waiting ones are admitted while seats, budget and blocks allow. With
chunked prefill a prompt takes what budget is left; vLLM's partial-prefill knobs keep short
prompts from waiting behind long ones; `prefill_first=True` puts prompts before decodes. The
policies (policies/: priorities, static batching, the pacer's `prefill_chunk_cap`) override or set
the small hooks here (`_run_key`, `_victim_key`, ...).

Left out on purpose: fairness across users, lookahead scheduling, vLLM V0's even budget split.
"""
from collections import deque
from dataclasses import dataclass, field

from minillm.paging.block_manager import BlockManager
from minillm.engine.requests import check_partial_prefills
from minillm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    copies: list[tuple[int, int]] = field(default_factory=list)          # copy-on-write (src, dst)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (seq, its blocks)
    swap_in: list[tuple[Sequence, list[int], int]] = field(default_factory=list)
    # (seq, dst blocks, index of the first saved block they receive; earlier ones hit the cache)
    preempted: list[Sequence] = field(default_factory=list)
    # the host tier (paging/offload.py): (device block, host slot) and (host slot, device block)
    offload: list[tuple[int, int]] = field(default_factory=list)
    restore: list[tuple[int, int]] = field(default_factory=list)
    padding: list[str] = field(default_factory=list)   # static batching: finished members' rows

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, preemption_mode: str = "recompute",
                 prefill_first: bool = False, max_num_partial_prefills: int = 1,
                 max_long_partial_prefills: int = 1, long_prefill_token_threshold: int = 0):
        if not isinstance(prefill_first, bool):
            raise TypeError(f"prefill_first must be a bool, got {type(prefill_first).__name__}")
        check_partial_prefills(max_num_partial_prefills, max_long_partial_prefills,
                               long_prefill_token_threshold, enable_chunked_prefill)
        self.max_num_partial_prefills = max_num_partial_prefills
        self.max_long_partial_prefills = max_long_partial_prefills
        self.long_prefill_token_threshold = long_prefill_token_threshold   # 0: no prompt is long
        self._partial = [0, 0]                # this step: prompts left mid-prefill, long ones of them
        self.prefill_chunk_cap: int | None = None   # set by the engine's PrefillPacer; None: no cap
        self.bm = block_manager
        self.prefill_first = prefill_first   # False: decodes first (see the module docstring)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # kept in arrival order
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    # ---- queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child joins the running queue right after its parent."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whatever queue holds it and free its blocks (finish or abort)."""
        for q in (self.waiting, self.running, self.swapped):
            if seq in q:
                q.remove(seq)
        if seq.seq_id in self.bm:
            self.bm.free(seq.seq_id)
        seq.swapped_kv = None

    def undo(self, out: SchedulerOutput) -> None:
        """The step `out` failed before its results came back: every sequence it scheduled (and
        any swap-out not made) goes back to the waiting queue's front, blocks freed, to recompute."""
        lost = [s for s, _ in out.scheduled] + [s for s, _ in out.swap_out if s.swapped_kv is None]
        for seq in sorted(set(lost), key=lambda s: (s.arrival_time, s.seq_id), reverse=True):
            for q in (self.running, self.swapped):
                if seq in q:
                    q.remove(seq)
            if seq.seq_id in self.bm:
                self.bm.free(seq.seq_id)
            seq.clear_drafts()
            seq.swapped_kv, seq.num_computed_tokens = None, 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.bm.forget_moves(out.offload, out.restore)   # host-tier copies maybe never made

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        self._partial = [0, 0]
        self._preempt_for_waiting(out)
        given = len(out.preempted)      # evicted for a better class, not for memory
        order = sorted(self.running, key=self._run_key)
        prefill_seen, admitted = False, False
        if self.prefill_first:   # prompts' chunks first, then new prompts, then the decodes
            order = [s for s in order if s.num_uncomputed > 1] + [s for s in order if s.num_uncomputed <= 1]
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            need = seq.num_uncomputed
            if need > 1:  # a prompt (or recompute) partly done: its blocks are already booked
                n = self._prefill_size(need, budget, prefill_seen)
                self._count_partial(need, n)   # admitted earlier: it holds its slot, chunk or not
                if n:
                    out.scheduled.append((seq, n))
                    budget -= n
                    prefill_seen = True
                continue
            if self.prefill_first and not admitted and self._admission_open():
                admitted = True
                budget, prefill_seen = self._admit(out, budget, prefill_seen)
            if budget < 1:
                continue
            if seq.draft_token_ids and (1 + len(seq.draft_token_ids) > budget or not
                                        self.bm.can_append(seq.seq_id, self._growth(seq))):
                # drafts are optional: drop them rather than exceed the budget or preempt anyone
                seq.clear_drafts()
            if not self._make_room(seq, out):
                continue  # seq itself was preempted
            new = seq.token_ids_from(self.bm.num_tokens(seq.seq_id))   # newest token + drafts
            out.copies += self.bm.append_tokens(seq.seq_id, new)
            out.scheduled.append((seq, 1 + len(seq.draft_token_ids)))
            budget -= 1 + len(seq.draft_token_ids)
        if len(out.preempted) == given:   # nobody lost their blocks to memory pressure this step
            budget, prefill_seen = self._swap_in(out, budget, prefill_seen)
            if self._admission_open() and not admitted:
                self._admit(out, budget, prefill_seen)
        out.offload, out.restore = self.bm.take_kv_moves()   # host-tier copies booked this step
        return out

    def _prefill_size(self, need: int, budget: int, prefill_seen: bool) -> int:
        if self.chunked:
            return min(need, budget, self.long_prefill_token_threshold or need,
                       self.prefill_chunk_cap or need)
        return need if need <= budget or not prefill_seen else 0

    def _is_long(self, need: int) -> bool:
        return 0 < self.long_prefill_token_threshold < need

    def _count_partial(self, need: int, n: int) -> None:
        """A prompt with `need` tokens to compute runs `n` of them this step: count it if it stays
        mid-prefill (a running prompt that got no budget this step stays mid-prefill too)."""
        if n < need:
            self._partial[0] += 1
            self._partial[1] += self._is_long(need)

    def _partial_slot(self, need: int, n: int) -> bool:
        """May a waiting prompt start a prefill of `n` of its `need` tokens without breaking
        max_num_partial_prefills / max_long_partial_prefills? (One that finishes takes no slot.)"""
        if n == need:
            return True
        if self._partial[0] >= self.max_num_partial_prefills:
            return False
        return not self._is_long(need) or self._partial[1] < self.max_long_partial_prefills

    # ---- policy hooks (fcfs here; PriorityScheduler overrides them) -------------------------------
    def _run_key(self, seq: Sequence) -> tuple:
        """Order of running sequences in a step: decodes before prompt chunks, oldest first."""
        return (seq.num_uncomputed > 1, seq.arrival_time, seq.seq_id)

    def _victim_key(self, seq: Sequence) -> tuple:
        """Memory pressure preempts the running sequence with the largest key: the latest arrival."""
        return (seq.arrival_time, seq.seq_id)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """fcfs never evicts a running request for a waiting one."""

    def _may_swap_in(self, seq: Sequence) -> bool:
        return True

    def _admission_open(self) -> bool:
        """fcfs admits new prompts only when nothing is swapped out (those come back first)."""
        return not self.swapped

    def _growth(self, seq: Sequence) -> int:
        """Tokens seq adds to its block table this step: the newest token and its drafts."""
        return seq.num_tokens + len(seq.draft_token_ids) - self.bm.num_tokens(seq.seq_id)

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt latest-arrived running sequences until seq can append; False if seq went."""
        while not self.bm.can_append(seq.seq_id, self._growth(seq)):
            victim = max((s for s in self.running if s.status is SequenceStatus.RUNNING),
                         key=self._victim_key)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        out.preempted.append(seq)
        seq.clear_drafts()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # a block still waiting for its host-tier restore has nothing to swap out yet
        if (self.preemption_mode == "swap" and seq.num_computed_tokens > 0
                and not self.bm.has_pending_restores(seq.seq_id)):
            table = self.bm.block_table(seq.seq_id)
            keep = self.bm.blocks_needed(seq.num_computed_tokens)
            out.swap_out.append((seq, table[:keep]))
            self.bm.free(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)   # victims go latest-first, so earlier ones end in front
        else:
            self.bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _swap_in(self, out: SchedulerOutput, budget: int, prefill_seen: bool):
        while self.swapped and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.swapped[0]
            if not self._may_swap_in(seq) or self.bm.num_free_blocks < self.bm.blocks_needed(seq.num_tokens):
                break
            n = (self._prefill_size(seq.num_uncomputed, budget, prefill_seen)
                 if seq.num_uncomputed > 1 else 1)
            if n == 0:
                break
            self._count_partial(seq.num_uncomputed, n)
            self.swapped.popleft()
            done = seq.token_ids[:seq.num_computed_tokens]
            first = self.bm.allocate(seq.seq_id, done) // self.bm.block_size  # cached blocks
            self.bm.mark_computed(seq.seq_id, len(done))
            out.swap_in.append((seq, self.bm.block_table(seq.seq_id)[first:], first))
            out.copies += self.bm.append_tokens(seq.seq_id, seq.token_ids[len(done):])
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: (s.arrival_time, s.seq_id))
            out.scheduled.append((seq, n))
            budget -= n
            prefill_seen |= n > 1
        return budget, prefill_seen

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running slots a sequence takes: a request with n > 1 forks into n sequences after
        its prompt, so until it has sampled its first token it books all n of them."""
        return (seq.params.best_of or seq.params.n) if seq.index == 0 and not seq.output_token_ids else 1

    def _may_admit(self, seq: Sequence) -> bool:
        """Continuous batching: anyone may join at any step (StaticScheduler says otherwise)."""
        return True

    def _admit(self, out: SchedulerOutput, budget: int, prefill_seen: bool) -> tuple[int, bool]:
        """Admit waiting prompts in arrival order while seats, budget and blocks allow (one that
        would break the partial-prefill limits is stepped over and keeps its place); returns the
        budget left and whether this step now holds a prefill."""
        passed = []          # prompts stepped over for want of a partial-prefill slot
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._may_admit(seq):
                break
            if sum(map(self._seats, self.running)) + self._seats(seq) > self.max_num_seqs:
                break
            tokens = seq.token_ids
            # probe first, allocate only what runs: a failed probe must not evict cached blocks
            cached = self.bm.num_cached_tokens(tokens) if seq.reads_prefix_cache else 0
            need = len(tokens) - cached
            n = self._prefill_size(need, budget, prefill_seen)
            if n == 0 or not self.bm.can_allocate(tokens, seq.reads_prefix_cache):
                break
            if not self._partial_slot(need, n):
                passed.append(self.waiting.popleft())   # keeps its place; the next one may fit
                continue
            seq.num_computed_tokens = self.bm.allocate(seq.seq_id, tokens, seq.reads_prefix_cache)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            out.scheduled.append((seq, n))
            self._count_partial(need, n)
            budget -= n
            prefill_seen = True
        self.waiting.extendleft(reversed(passed))
        return budget, prefill_seen
