"""Chapter 7: quantization of the weights and of the KV cache (formats, kernels, calibration)."""
