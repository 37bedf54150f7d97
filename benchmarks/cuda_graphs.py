"""CUDA graphs (chapter 1, GPU only), the record: `minillm.lab.cuda_graphs.measure_launch_overhead`
on the benchmark model, written to cuda_graphs_<gpu>.json.

    python -m benchmarks cuda_graphs [--quick]
"""
import torch

from benchmarks.gpu_model import bench_model
from benchmarks.records import write_result
from minillm.lab.cuda_graphs import measure_launch_overhead
from minillm.model.loading import default_device


def run(quick: bool = False, device=None, out_dir=None) -> dict:
    """Benchmark entry point (`python -m benchmarks` protocol): writes cuda_graphs_<gpu>.json.

    On a machine without CUDA it writes nothing and returns {"skipped": reason}.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda" or not torch.cuda.is_available():
        print("cuda_graphs: skipped, CUDA graphs need a CUDA device")
        return {"benchmark": "cuda_graphs", "skipped": "CUDA graphs need a CUDA device"}
    model, _, weights = bench_model(device)                  # bf16 on cuda
    record = measure_launch_overhead(model, steps=16 if quick else 64)
    record.update(quick=quick, weights=weights)
    record["path"] = str(write_result("cuda_graphs", record, device, out_dir))
    print(f"cuda_graphs: eager {record['eager_ms_per_step']:.3f} ms/step, graph "
          f"{record['graph_ms_per_step']:.3f} ms/step -> {record['graph_speedup']:.2f}x")
    return record
