"""The paged KV cache (chapter 3): `block_manager` (block tables, reference counts,
copy-on-write; pure Python, no tensors) with the objects it owns, `prefix_cache` and `offload`
(the host tier's bookkeeping), `paged_cache` (the KV pools, written and read through the block
tables by the attention in minillm/attention/paged.py; `CacheSpec` describes one), `kv_storage`
(the int8 / fp8 formats a pool may store) and `sizing` (how many blocks the engine's pool and host
tier get from its config)."""
