"""Past one machine (chapter 11): process groups over torch.distributed, tensor and pipeline
parallelism, and a prefilled request's KV moved between engines (`kv_transfer`). Sits above the
engine: `tp_runner` is an engine runner that drives workers built from these pieces, and `LLM`
hands it to the engine; the one-process engine imports nothing from here."""
