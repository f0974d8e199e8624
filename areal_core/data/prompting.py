"""Turn a record into prompt token ids, and generated ids back into text."""

from __future__ import annotations

from areal_core.data.records import Record


def prompt_text(record: Record, instruction: str | None = None) -> str:
    return record.prompt if instruction is None else f"{record.prompt}\n{instruction}"


def encode_prompt(tokenizer, record: Record, instruction: str | None = None) -> list[int]:
    """Token ids of the prompt the policy is asked to continue.

    With a chat template: one user message (the prompt, plus the instruction
    on a new line if given) and the generation prompt. Without one (the char
    tokenizer, trained on bare prompts): the bare prompt, no special tokens;
    the instruction is not used.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt_text(record, instruction)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(record.prompt, add_special_tokens=False)]


def decode_response(tokenizer, ids: list[int]) -> str:
    """Text of generated ids, special tokens (EOS, pad) skipped."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)
