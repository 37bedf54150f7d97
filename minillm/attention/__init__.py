"""Attention: chapter 9 at long context, and the paged attention the paged cache calls.

- `reference.py`  the five-line materialized attention (the trusted reference) and the input checks
- `tiled.py`      FlashAttention's forward: query tiles x key tiles with the online softmax
- `io_model.py`   main-memory traffic of standard vs tiled attention for an on-chip memory of M elements
- `memory.py`     `peak_bytes(fn, ...)`: the peak of live tensor bytes a call allocates (any device)
- `metadata.py`   a paged step's index tensors: slot mapping, gather slots, masks (built once per step)
- `paged.py`      attention over block tables (write through the slot mapping, gather, SDPA) and
                  the dense references it is checked against
- `flash_decoding.py`  decode attention over the paged cache split along the context, partials merged
                   by log-sum-exp (`EngineConfig(attention_backend="flash_decoding")`)
- `backends.py`   which of the two a step takes ("auto": this machine's timed crossover)
"""
from minillm.attention.reference import attention_reference, check_attention_inputs
from minillm.attention.backends import ATTENTION_BACKENDS
from minillm.attention.flash_decoding import DecodePlan, flash_decode, merge_partials
from minillm.attention.tiled import (TileStats, flash_attention, flash_attention_stats, key_tiles,
                                     online_softmax_step)

__all__ = ["attention_reference", "check_attention_inputs", "flash_attention", "flash_attention_stats",
           "TileStats", "key_tiles", "online_softmax_step", "flash_decode", "merge_partials", "DecodePlan",
           "ATTENTION_BACKENDS"]
