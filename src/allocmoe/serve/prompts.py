"""From what a user sends (a string, token ids, or chat messages) to prompt token ids."""

from __future__ import annotations

from typing import Any

from ..core.files import read_utf8
from ..errors import AllocMoeError


def read_chat_template(path) -> str:
    """A Jinja chat template file (data: rendered in transformers' sandbox, never run as Python)."""
    return read_utf8(path, "chat template file")


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], chat_template: str | None = None,
                    max_tokens: int | None = None) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template (or `chat_template`), ending
    with the assistant's turn opened. `max_tokens`: see `text_prompt_ids`."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise AllocMoeError("the model's tokenizer has no chat template; send a plain prompt instead, "
                            "or give one with --chat-template FILE")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:        # jinja errors: a template that does not fit these messages
        raise AllocMoeError(f"the chat template could not render these messages: {exc}") from None
    return text_prompt_ids(tokenizer, text, special_tokens=False, max_tokens=max_tokens)


def text_prompt_ids(tokenizer, text: str, special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
    """Token ids of `text`. With `max_tokens`, text that cannot fit in fewer tokens is refused
    before it is tokenized (a megabyte of text costs seconds of tokenizer time and its memory)."""
    if max_tokens is not None:
        chars = _normalized_length(tokenizer, text)
        most = max_tokens * longest_token(tokenizer)
        if chars > most:
            raise AllocMoeError(f"the prompt has {chars} characters, more than the model's context of {max_tokens} "
                                "tokens can hold; shorten the prompt")
    return list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def longest_token(tokenizer) -> int:
    """Characters the longest vocabulary entry spells (added tokens included): no token covers more
    of a text, so a text of N characters needs at least N / this many tokens. (A byte-level entry
    spells one character per byte, and a character is at least one byte.)"""
    cached = getattr(tokenizer, "_allocmoe_longest_token", None)
    if cached is None:
        cached = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        try:
            tokenizer._allocmoe_longest_token = cached
        except AttributeError:
            pass
    return cached


def _normalized_length(tokenizer, text: str) -> int:
    """The text's length after the tokenizer's normalizer (which may merge characters), when it has one."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return len(normalizer.normalize_str(text)) if normalizer is not None else len(text)


def check_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise AllocMoeError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}); send ids the model's tokenizer made")
    return ids
