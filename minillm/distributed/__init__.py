"""Past one machine (chapter 11): process groups over torch.distributed, tensor and pipeline
parallelism. Sits between spec/quant and the engine: the engine's tensor-parallel runner drives
workers built from these pieces."""
