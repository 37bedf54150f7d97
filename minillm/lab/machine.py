"""The machine a chapter runs on, said once at the top, and the machine a committed record came from.

Every chapter's first code cell calls `this_machine()`: it sets the course's thread policy (one
torch thread in every chapter and in the records they quote), measures this machine's read
bandwidth once, and prints the CPU, cores, threads, bandwidth and load average. A chapter that
needs this machine's bandwidth uses the returned `.bandwidth`, so chapters run together agree.

    >>> from minillm.lab.machine import this_machine, record_origin
    >>> m = this_machine()                                  # doctest: +SKIP
    machine: Intel(R) Xeon(R) Processor, 2 cores, cpu, torch 2.13.0, 1 thread, read 14.2 GB/s, ...
    >>> record_origin(load_results("quant")[0])            # doctest: +SKIP
    'a committed record (Intel(R) Xeon(R) Processor, 1 thread, load 0.4, 2026-12-06 11:02 UTC)'

A load average near or above the core count means other work shared the CPU while the numbers
were taken; `this_machine` says so, and `record_origin` carries the record's own load.

Left out on purpose: pinning to cores and clock control (not portable, and readers' laptops
cannot do it).
"""
import os
import platform
from dataclasses import dataclass

import torch

from minillm._validate import check_int
from minillm.kernels.cpu_kernels import cpu_name
from minillm.model.loading import default_device

__all__ = ["Machine", "this_machine", "record_origin", "COURSE_THREADS"]

COURSE_THREADS = 1   # the thread policy of every chapter and of the records the chapters quote


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    device: str          # "cpu" or the GPU's name
    threads: int
    bandwidth: float     # measured read bandwidth, bytes/s, on `device`
    load: tuple          # 1, 5 and 15 minute load averages when the banner printed (or ())

    @property
    def busy(self) -> bool:
        """True when the 1-minute load average, less the one core the chapter itself keeps busy,
        was at least half the cores: other work shares the CPU and the timings."""
        return bool(self.load) and self.load[0] - 1.0 >= max(1.0, self.cores / 2)

    def line(self) -> str:
        load = " / ".join(f"{x:.2f}" for x in self.load) if self.load else "n/a"
        where = self.cpu if self.device == "cpu" else f"{self.device} (host {self.cpu})"
        return (f"machine: {where}, {self.cores} cores, torch {torch.__version__}, "
                f"{self.threads} thread{'s' if self.threads != 1 else ''}, "
                f"read {self.bandwidth / 1e9:.1f} GB/s, load {load}")


def _load() -> tuple:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return ()


def this_machine(threads: int = COURSE_THREADS, device=None, quiet: bool = False) -> Machine:
    """Set torch's thread count to `threads` (default: the course's one thread), measure the read
    bandwidth of `device` (default: cuda when present, else cpu) and print one line saying where the
    chapter runs. Returns a `Machine`; `.bandwidth` is in bytes/s."""
    check_int("threads", threads, 1, 1024)
    torch.set_num_threads(threads)
    dev = default_device() if device is None else torch.device(device)
    from minillm.lab.measure import measure_bandwidth   # lazy: measure imports the analysis stack
    bw = measure_bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    m = Machine(cpu=cpu_name() or platform.processor() or "unknown CPU", cores=os.cpu_count() or 1,
                device=name, threads=torch.get_num_threads(), bandwidth=bw, load=_load())
    if not quiet:
        print(m.line())
        if m.busy:
            print(f"  (load {m.load[0]:.1f} on {m.cores} cores: other work shares this CPU, "
                  "so timings below run slower and vary more than on a quiet machine)")
    return m


def record_origin(record: dict) -> str:
    """One phrase naming where a committed benchmark record was measured: CPU or GPU, threads,
    load average and date, from the record's `machine` block."""
    if not isinstance(record, dict):
        raise TypeError(f"record must be a dict read by load_results, got {type(record).__name__}")
    m = record.get("machine") or {}
    dev = m.get("device_name") or m.get("cpu") or "an unnamed machine"
    parts = [dev]
    if m.get("torch_threads") is not None and m.get("device", "cpu") == "cpu":
        t = m["torch_threads"]
        parts.append(f"{t} thread{'s' if t != 1 else ''}")
    if m.get("load_average"):
        parts.append(f"load {m['load_average'][0]}")
    if m.get("date"):
        parts.append(m["date"])
    return "a committed record (" + ", ".join(parts) + ")"
