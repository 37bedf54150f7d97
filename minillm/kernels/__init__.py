"""Faster paths chosen on the reader's machine, outside the reference model: `cpu_kernels` (the
CPU matmul routes) and `cpu_tuning` (timing them on this machine, the cached table,
`accelerate`). CUDA graph capture of a decode step is measured in `minillm.bench.cuda_graphs`."""
