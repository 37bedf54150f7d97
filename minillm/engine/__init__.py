"""The serving engine (chapters 3-6), split as nano-vllm splits it: `sequence` (request and
sequence state), `scheduler` (decides; static batching, priorities, the SLO controller: `policies/`),
`model_runner` (runs tensors), `sampler` (logits -> tokens, drafts verified, one seed rule),
`llm_engine` (owns them: `LLMEngine.step()` = schedule -> run -> sample -> update_from_output;
`output` turns the tokens into RequestOutputs; speculative drafts come from `minillm.spec.decoder`).
The block manager, paged attention and pool sizing it books, runs and reads are in
`minillm.paging`; tensor parallelism and moving a request's KV between engines (chapter 11) sit a
floor above, in `minillm.distributed`."""
from minillm.engine.llm_engine import EngineConfig, LLMEngine  # noqa: F401
