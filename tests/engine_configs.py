"""Engine settings the equivalence tests of chapter 7 share (block sizes, chunking, both
preemption modes, prefix caching), sized for `workload()`: 8 prompts of 6-35 tokens that share a
5-token prefix, each generating 1-20 tokens (at most 55 tokens a request)."""
import random

CONFIGS = {
    "bs1": dict(block_size=1, num_blocks=300, max_num_seqs=64, max_num_batched_tokens=64),
    "bs3_chunk8": dict(block_size=3, num_blocks=120, max_num_seqs=4, max_num_batched_tokens=8),
    "bs16_nochunk": dict(block_size=16, num_blocks=30, max_num_seqs=64, max_num_batched_tokens=64,
                         enable_chunked_prefill=False),
    "preempt_recompute": dict(block_size=16, num_blocks=5, max_num_seqs=64, max_num_batched_tokens=64),
    "preempt_swap": dict(block_size=3, num_blocks=19, max_num_seqs=32, max_num_batched_tokens=32,
                         preemption_mode="swap"),
    "prefix_cache_swap": dict(block_size=3, num_blocks=19, max_num_seqs=32, max_num_batched_tokens=32,
                              enable_prefix_caching=True, preemption_mode="swap"),
}


def workload(seed: int = 0, vocab_size: int = 256):
    """(prompts, max_tokens): a shared prefix (for prefix caching), ragged lengths."""
    rng = random.Random(seed)
    prompts = [[7, 8, 9, 10, 11] + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))]
               for _ in range(8)]
    return prompts, [rng.randint(1, 20) for _ in prompts]
