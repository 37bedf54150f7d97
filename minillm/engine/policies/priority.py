"""Priorities and queue-wait bounds (chapter 8): `scheduling_policy="priority"` in `EngineConfig`.

A request carries an int `priority` (lower is served first, as in vLLM). `PriorityClass` names
the allowed values and may bound the wait for a request's first admission (`max_queue_wait`,
seconds on the engine's clock, checked at the start of each step): past it the request is
promoted ahead of every unpromoted one, or with `on_timeout="reject"` finished with finish_reason
"abort" and an `error`. `SEED_CLASSES`: interactive 50 ms, standard 200 ms, batch 1000 ms.

`PriorityScheduler` changes four decisions of the fcfs `Scheduler`: the waiting order (promoted,
priority, arrival); priority preemption of strictly lower running classes, latest first (never
within a class); the memory-pressure victim (lowest class, then latest); and the order in which
prompt chunks take the token budget. A promoted request ranks first but evicts as its own class.

Left out on purpose: fairness across users, aging of every request (only bounded classes
promote), and deadlines on the total latency (only the queue wait is bounded).
"""
import math
from dataclasses import dataclass

from minillm.engine.requests import check_priority_value
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import Sequence, SequenceStatus

ON_TIMEOUT = ("promote", "reject")
WAIT_TOLERANCE = 1e-9   # s: a wait equal to the bound up to the clock's float rounding is not past it


@dataclass(frozen=True)
class PriorityClass:
    """One class of traffic: its name, its priority value (lower = first) and its queue-wait bound."""

    name: str
    priority: int
    max_queue_wait: float | None = None    # seconds waiting before on_timeout (None: no bound)
    on_timeout: str = "promote"            # or "reject"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"PriorityClass.name must be a non-empty str, got {self.name!r}")
        check_priority_value("PriorityClass.priority", self.priority)
        w = self.max_queue_wait
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise TypeError(f"PriorityClass.max_queue_wait must be None or a number of seconds > 0, "
                                f"got {w!r}")
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"PriorityClass.max_queue_wait must be None or finite > 0 seconds, got {w!r}")
        if self.on_timeout not in ON_TIMEOUT:
            raise ValueError(f"PriorityClass.on_timeout must be 'promote' or 'reject', got {self.on_timeout!r}")


SEED_CLASSES = (PriorityClass("interactive", 0, 0.05), PriorityClass("standard", 1, 0.2),
                PriorityClass("batch", 2, 1.0))


def check_classes(policy: str, classes) -> None:
    """EngineConfig's check of `scheduling_policy` and `priority_classes`."""
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
    if not isinstance(classes, tuple) or not all(isinstance(c, PriorityClass) for c in classes):
        raise TypeError(f"priority_classes must be a tuple of PriorityClass, got {classes!r}")
    if classes and policy != "priority":
        raise ValueError("priority_classes need scheduling_policy='priority'")
    for what, vals in (("names", [c.name for c in classes]), ("priorities", [c.priority for c in classes])):
        if len(set(vals)) != len(vals):
            raise ValueError(f"priority_classes must have unique {what}, got {vals}")


def queue_timeouts(waiting, requests: dict, classes, now: float) -> tuple[list[Sequence], list[Sequence]]:
    """Waiting sequences past their class's bound, not yet admitted once: (to promote, to reject).
    Sets nothing but the rejected ones' `error`; `apply_queue_timeouts` acts on the lists."""
    by_prio = {c.priority: c for c in classes}
    promote, reject = [], []
    for seq in waiting:
        cls = by_prio.get(seq.priority)
        m = requests[seq.request_id].metrics
        if (cls is None or cls.max_queue_wait is None or seq.promoted or seq.index != 0
                or m.first_scheduled_time is not None):
            continue
        waited = now - m.arrival_time
        if waited > cls.max_queue_wait + WAIT_TOLERANCE:
            if cls.on_timeout == "reject":
                seq.error = (f"queue timeout: waited {waited:.3g} s > max_queue_wait "
                             f"{cls.max_queue_wait:g} s of class {cls.name!r}")
                reject.append(seq)
            else:
                promote.append(seq)
    return promote, reject


def apply_queue_timeouts(scheduler, requests: dict, classes, now: float, step: int) -> list:
    """Promote or reject the waiting requests past their bound; returns the rejected `Request`s
    (finished with finish_reason "abort" and `error` set; a waiting request holds no blocks)."""
    promote, reject = queue_timeouts(scheduler.waiting, requests, classes, now)
    for seq in promote:
        seq.promoted = True
        requests[seq.request_id].metrics.num_promotions += 1
    for seq in reject:
        scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        m = requests[seq.request_id].metrics
        m.finish_time, m.finish_step = now, step
    return [requests[s.request_id] for s in reject]


def rank(seq: Sequence) -> tuple[int, int]:
    """Effective priority: (0, 0) once promoted, ahead of every class (negative ones too), else
    (1, its priority)."""
    return (0, 0) if seq.promoted else (1, seq.priority)


def queue_key(seq: Sequence) -> tuple:
    """Waiting / swapped order: promoted first (by arrival), then by (priority, arrival)."""
    return (*rank(seq), seq.arrival_time, seq.seq_id)


class PriorityScheduler(Scheduler):
    """The fcfs scheduler with priority order, priority preemption and a class-aware victim."""

    num_priority_preemptions = 0

    def schedule(self) -> SchedulerOutput:
        self._sort_queues()
        return super().schedule()

    def _sort_queues(self) -> None:
        for q in (self.waiting, self.swapped):
            items = sorted(q, key=queue_key)
            q.clear()
            q.extend(items)

    def _run_key(self, seq: Sequence) -> tuple:
        return (seq.num_uncomputed > 1, *rank(seq), seq.arrival_time, seq.seq_id)

    def _victim_key(self, seq: Sequence) -> tuple:
        return (*rank(seq), seq.arrival_time, seq.seq_id)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        super()._preempt(seq, out)
        self._sort_queues()   # the victim goes by its priority, not to the front

    def _may_admit(self, seq: Sequence) -> bool:
        # a swapped request of a better (or equal, earlier) rank comes back before seq is admitted
        return not self.swapped or queue_key(seq) < queue_key(self.swapped[0])

    def _may_swap_in(self, seq: Sequence) -> bool:
        return not self.waiting or queue_key(seq) < queue_key(self.waiting[0])

    def _admission_open(self) -> bool:
        return True           # _may_admit compares each candidate with the swapped queue's head

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority preemption for the best waiting request (see the module docstring, 2.)."""
        if not self.waiting:
            return
        head = self.waiting[0]
        victims = sorted((s for s in self.running if rank(s) > (1, head.priority)),
                         key=self._victim_key, reverse=True)
        if not victims or self._fits(head) or not self._may_admit(head):
            return            # room already, or a better swapped-out request comes back first
        seats = sum(map(self._seats, self.running)) + self._seats(head) - self.max_num_seqs
        blocks = self.bm.blocks_needed(len(head.token_ids)) - self.bm.num_free_blocks
        if (seats > sum(map(self._seats, victims)) or
                blocks > sum(len(self.bm.block_table(s.seq_id)) for s in victims)):
            return            # even all of them would not make room: evict nobody
        for victim in victims:
            self._preempt(victim, out)
            self.num_priority_preemptions += 1
            if self._fits(head):
                return

    def _fits(self, seq: Sequence) -> bool:
        """A seat and blocks for seq's prompt (the token budget is the step's, not a reason to evict)."""
        seated = sum(map(self._seats, self.running)) + self._seats(seq) <= self.max_num_seqs
        return seated and self.bm.can_allocate(seq.token_ids)
