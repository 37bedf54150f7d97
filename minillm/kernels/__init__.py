"""Faster paths chosen on the reader's machine, outside the reference model, switched on in one
named call (`cpu_tuning.accelerate(model)`, which the front door's `minillm.load_model` makes on
a CPU): `cpu_kernels` (the CPU matmul routes), `route_timing` (timing them on a group of weights),
`cpu_tuning` (the tuned table, the quick first-start probe, `accelerate` / `plain`),
`tuning_cache` (the cache files, the tuners' locks, the one-line notices), `load_now` (how
busy the machine is now), `route_priors` (the untimed guess), `background` (the quiet-time
tuner), `flat_forward` (the model's forward as one loop, bit for bit the reference's), and
`compiled` (torch.compile of the decode and verify steps, timed against eager and kept only where
it wins: `compile_if_faster`). `python -m minillm.kernels` runs the full tuning. CUDA graph
capture of a decode step is measured in `minillm.lab.cuda_graphs`.
"""
