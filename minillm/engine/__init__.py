"""The serving engine (chapters 3-6), split as nano-vllm splits it: `sequence` (request and
sequence state), `scheduler` (decides; `static_scheduler` is the static-batching baseline),
`model_runner` (runs tensors), `sampler` (logits -> tokens, drafts verified, one seed rule),
`llm_engine` (owns them: `LLMEngine.step()` = schedule -> run -> sample -> update_from_output)
and `spec_decoder` (proposes speculative drafts); `kv_transfer` moves a prefilled request's KV
blocks and first token from one engine to another (chapter 11). The block manager and paged attention it
books and runs are in `minillm.paging`."""
from minillm.engine.llm_engine import EngineConfig, LLMEngine  # noqa: F401
