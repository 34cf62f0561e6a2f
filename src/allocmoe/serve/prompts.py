"""From what a user sends (a string, token ids, or chat messages) to prompt token ids."""

from __future__ import annotations

from typing import Any

from ..core.files import read_utf8
from ..errors import AllocMoeError


def read_chat_template(path) -> str:
    """A Jinja chat template file (data: rendered in transformers' sandbox, never run as Python)."""
    return read_utf8(path, "chat template file")


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template (or `chat_template`), ending
    with the assistant's turn opened."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise AllocMoeError("the model's tokenizer has no chat template; send a plain prompt instead, "
                            "or give one with --chat-template FILE")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:        # jinja errors: a template that does not fit these messages
        raise AllocMoeError(f"the chat template could not render these messages: {exc}") from None
    return text_prompt_ids(tokenizer, text, special_tokens=False)


def text_prompt_ids(tokenizer, text: str, special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def check_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise AllocMoeError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}); send ids the model's tokenizer made")
    return ids
