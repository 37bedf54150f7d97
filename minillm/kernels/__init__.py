"""Faster paths chosen on the reader's machine, outside the reference model: `cpu_kernels` (the
CPU matmul routes), `cpu_tuning` (timing them on this machine, the cached table,
`accelerate`) and `flat_forward` (the model's forward as one loop, bit for bit the reference's).
CUDA graph capture of a decode step is measured in `minillm.bench.cuda_graphs`."""
