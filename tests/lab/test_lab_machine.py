"""The chapters' banner and the provenance line of a quoted record (minillm/lab/machine.py)."""
import pytest
import torch

from minillm.lab.machine import COURSE_THREADS, Machine, record_origin, this_machine


def test_banner_sets_the_thread_policy_and_measures(capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        m = this_machine(device="cpu")
        assert torch.get_num_threads() == COURSE_THREADS == m.threads == 1
        out = capsys.readouterr().out
        assert out.startswith("machine: ") and "1 thread," in out and "GB/s" in out
        assert m.bandwidth > 1e8 and m.cores >= 1
    finally:
        torch.set_num_threads(before)


def test_bad_threads_are_refused():
    with pytest.raises(ValueError, match="threads"):
        this_machine(threads=0, quiet=True)
    with pytest.raises(TypeError, match="threads"):
        this_machine(threads=1.5, quiet=True)


def test_busy_means_load_of_half_the_cores():
    m = Machine("x", 4, "cpu", 1, 1e10, (3.5, 1.0, 1.0))
    assert m.busy and not Machine("x", 4, "cpu", 1, 1e10, (2.5, 1.0, 1.0)).busy
    # on 2 cores the chapter's own process makes a load of about 1: that is not other work
    assert not Machine("x", 2, "cpu", 1, 1e10, (1.1, 1.0, 1.0)).busy
    assert Machine("x", 2, "cpu", 1, 1e10, (2.2, 1.0, 1.0)).busy
    assert not Machine("x", 4, "cpu", 1, 1e10, ()).busy


def test_record_origin_names_machine_threads_load_and_date():
    rec = {"machine": {"device": "cpu", "cpu": "AMD EPYC", "torch_threads": 2, "load_average": [7.07, 5.6, 4],
                       "date": "2026-12-02 05:10 UTC"}}
    assert record_origin(rec) == "a committed record (AMD EPYC, 2 threads, load 7.07, 2026-12-02 05:10 UTC)"
    gpu = {"machine": {"device": "cuda", "device_name": "NVIDIA H200", "torch_threads": 16}}
    assert record_origin(gpu) == "a committed record (NVIDIA H200)"
    with pytest.raises(TypeError, match="record"):
        record_origin([rec])
