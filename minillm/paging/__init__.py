"""The paged KV cache (chapter 3): `block_manager` (block tables, reference counts,
copy-on-write, prefix caching; pure Python, no tensors), `metadata` (a step's index tensors:
slot mapping, gather slots, masks) and `paged_attention` (the KV pool, writes through the slot
mapping, attention over block tables, and the dense references)."""
