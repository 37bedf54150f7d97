"""Every prompt list the chapters, the demo and the benchmarks share, in one place.

- `DEMO_PROMPTS`: `python -m minillm demo`'s batch-1 generations;
- `DEMO_QUESTIONS`: the chat questions the demo serves through the engine (and in Q4_1);
- `DECODE_PROMPTS`: chapter 0's decode benchmark (batch 1 takes the first, batch 8 all eight);
- `SPEC_PROMPTS`: chapter 6's input-grounded tasks (summarize, rewrite, extract, code edit), the
  prompts of the speculative-decoding benchmark and of the recorded schedule (`spec_schedule.json`);
- `SELF_DRAFTS`, `SPEC_SETTINGS`, `NGRAM_SETUP`: chapter 6's draft models and its one n-gram setup.

Chapter 7's quality prompts stay with their check (`quant.quality.CHAT_PROMPTS`).
Left out on purpose: anything downloaded (`datasets` reads HumanEval from an installed package).
"""
from minillm.spec.proposers import bf16_copy, early_exit_model, layer_skip_model

DEMO_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain in two sentences why the sky is blue.", "Give three tips for a first marathon."]

DEMO_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
                  "Give three tips for learning to cook.", "Why is the sky blue?"]

DECODE_PROMPTS = ["Explain how a CPU cache works.", "Write a haiku about the sea.",
                  "What is the capital of France?", "Give three tips for learning to cook.",
                  "Why is the sky blue?", "Summarize the plot of Hamlet.",
                  "How do vaccines work?", "Describe a cat to someone who has never seen one."]

SPEC_PROMPTS = {
    "summarize": "Text: The city council met on Tuesday to discuss the new bike lanes on Main Street. "
    "Council members agreed that the lanes will be painted green and separated from traffic by a "
    "low curb. Work starts in March and should finish by the end of May. Shop owners asked for "
    "loading zones, and the council promised two loading zones near the market.\n\nSummarize the "
    "text above in three sentences, reusing its exact wording where possible.",
    "rewrite": "Rewrite the following paragraph, changing only the word 'cat' to 'dog' everywhere "
    "and keeping everything else the same:\n\nThe cat sat by the window every morning. The cat "
    "watched the birds in the garden and waited for the sun. When the sun came out, the cat "
    "stretched, yawned, and walked slowly to the kitchen to ask for breakfast.",
    "extract": "Here are some records:\nName: Alice Smith, Email: alice.smith@example.com, City: "
    "Paris\nName: Bob Jones, Email: bob.jones@example.com, City: Berlin\nName: Carol White, Email: "
    "carol.white@example.com, City: Madrid\nName: David Brown, Email: david.brown@example.com, "
    "City: Rome\n\nList every name with its email, one per line, in the format 'Name - Email'.",
    "code_edit": "Here is a Python function:\n\ndef total_price(items, tax_rate):\n    total = 0\n"
    "    for item in items:\n        total = total + item.price * item.quantity\n    total = total "
    "* (1 + tax_rate)\n    return round(total, 2)\n\nRename the variable 'total' to 'subtotal' and "
    "return the complete edited function.",
}
SELF_DRAFTS = {  # name -> (builder, description)
    "bf16": (bf16_copy, "all 30 layers in bfloat16"),
    "layer_skip": (lambda m: layer_skip_model(m, [12, 16, 20, 24]), "26 layers: skips 12, 16, 20, 24"),
    "early_exit": (lambda m: early_exit_model(m, 24), "first 24 of 30 layers"),
}
# min_ngram=2: on a CPU a 9-token verify costs about 1.5-2.5 1-token steps (forward_cost in the
# decode records, by machine), so a proposal from a single-token match (often wrong) can cost more than it saves;
# on the recorded schedules 1- and 2-token matches predict the same speedup at K = 8.
# the speculative-decoding benchmark's sizes: {quick: settings}
SPEC_SETTINGS = {False: dict(max_new_tokens=64, k_ngram=8, min_ngram=2, k_draft=4, repeat=2,
                             draft_prompts=("summarize", "code_edit")),
                 True: dict(max_new_tokens=24, k_ngram=8, min_ngram=2, k_draft=4, repeat=1,
                            draft_prompts=("summarize",))}
# The one n-gram setup of chapter 6: the notebook's own run, the benchmark and the ceiling replayed
# from spec_schedule.json (recorded with max_new_tokens = 64) all use it.
NGRAM_SETUP = dict(max_new_tokens=SPEC_SETTINGS[False]["max_new_tokens"],
                   num_speculative_tokens=SPEC_SETTINGS[False]["k_ngram"],
                   min_ngram=SPEC_SETTINGS[False]["min_ngram"])
