"""Chat helpers: apply the tokenizer's chat template, generate, decode the reply."""
import torch

from minillm.model.generate import generate


def encode_chat(tokenizer, messages) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant turn's header.

    `messages` is a user string or a list of {"role", "content"} dicts.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty str or list of {'role', 'content'} dicts")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc      # BatchEncoding or plain list
    return list(ids)


def chat(model, tokenizer, messages, max_new_tokens: int = 128, temperature: float = 0.0,
         top_k: int | None = None, top_p: float | None = None,
         generator: torch.Generator | None = None) -> str:
    """One assistant reply as text; stops at the tokenizer's end-of-turn token."""
    ids = encode_chat(tokenizer, messages)
    new = generate(model, ids, max_new_tokens, temperature, top_k, top_p, generator,
                   stop_token_ids=[tokenizer.eos_token_id])
    return tokenizer.decode(new, skip_special_tokens=True)
