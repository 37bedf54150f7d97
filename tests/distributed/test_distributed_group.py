"""Process groups (minillm/distributed/group.py): collectives against values computed by hand,
a worker's death named, no process left behind."""
import os
import signal
import time

import pytest
import torch

from minillm.distributed.group import WorkerDied, WorkerGroup
from procs import alive


def _echo(rank, world_size, comm):
    """Worker side of `test_collectives`: the same calls as the driver, in the same order."""
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t)
    comm.all_gather(torch.full((2,), float(rank)))
    job = comm.broadcast_object()
    if rank == 1:
        comm.send(torch.arange(4.0) * job["scale"], 0)
    comm.barrier()


def _wait_forever(rank, world_size, comm):
    comm.broadcast_object()        # blocks until the driver speaks or goes away




def test_collectives_give_the_hand_computed_values_and_count_payload_bytes():
    group = WorkerGroup.start(3, _echo, backend="gloo", threads=1)
    try:
        comm = group.comm
        t = torch.full((3,), 1.0)
        assert comm.all_reduce(t).tolist() == [6.0, 6.0, 6.0]          # 1 + 2 + 3
        assert comm.all_gather(torch.zeros(2)).tolist() == [0, 0, 1, 1, 2, 2]
        comm.broadcast_object({"scale": 2.0})
        got = comm.recv(torch.empty(4), 1)
        assert got.tolist() == [0.0, 2.0, 4.0, 6.0]
        comm.barrier()
        s = comm.stats
        assert s["all_reduce"] == {**s["all_reduce"], "calls": 1, "bytes": 3 * 4}
        assert (s["all_gather"]["calls"], s["all_gather"]["bytes"]) == (1, 2 * 4)
        assert (s["recv"]["calls"], s["recv"]["bytes"]) == (1, 4 * 4)
    finally:
        group.shutdown()
    assert not any(alive(pid) for pid in group.pids)


def test_a_killed_worker_is_named_and_shutdown_leaves_nothing_behind():
    group = WorkerGroup.start(3, _wait_forever, backend="gloo", threads=1)
    pids = group.pids
    os.kill(pids[1], signal.SIGKILL)
    for _ in range(100):
        if not group.processes[1].is_alive():
            break
        time.sleep(0.05)
    with pytest.raises(WorkerDied, match=r"rank 2 \(pid \d+\) exited with code -9"):
        group.check_alive()
    group.shutdown(timeout_s=1)
    group.shutdown()                                   # idempotent
    assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize("size", [0, 1.5, True])
def test_world_size_is_checked(size):
    with pytest.raises(ValueError, match="world_size"):
        WorkerGroup.start(size, _echo)
