"""Static batching, the baseline of chapter 4: a batch is admitted only when the previous one has
completely finished, and its finished members keep their rows until the longest member ends.

`StaticScheduler` is the continuous `Scheduler` with two changes: `_may_admit` lets in only the
members of the current batch (formed from the head of the waiting queue, up to `max_num_seqs`
requests), and `schedule` lists the finished members in `SchedulerOutput.padding`. The runner
feeds each padding row a dummy token into a scratch block, as a padded batch tensor would spend
compute on it: that is the cost continuous batching removes.
"""
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import Sequence


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch: set[str] = set()       # request ids of the current batch, not yet finished
        self.members: list[str] = []       # every request id of the current batch

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        if not any(s.request_id == seq.request_id for s in (*self.waiting, *self.running, *self.swapped)):
            self.batch.discard(seq.request_id)

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if out.scheduled:
            out.padding = [r for r in self.members if r not in self.batch]
        return out

    def _may_admit(self, seq: Sequence) -> bool:
        if not self.batch:                 # the previous batch is done: form the next one
            ids = []
            for s in self.waiting:
                if s.request_id not in ids and len(ids) < self.max_num_seqs:
                    ids.append(s.request_id)
            self.batch, self.members = set(ids), ids
        return seq.request_id in self.batch
