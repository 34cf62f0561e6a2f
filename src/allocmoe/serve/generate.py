"""`allocmoe.generate`: stream text from a model under a plan, and say what it spent.

    stream = allocmoe.generate(model, tok, "Once upon a time", plan="plan.json", max_new_tokens=32)
    for piece in stream:
        print(piece, end="", flush=True)
    print(stream.summary.line())

It runs the server's engine with one request, so what `generate` prints is what a served request
gets. With `plan=None` the model runs as it is: unmodified, or under the plans already applied to
it (`with apply_plan(model, plan): generate(model, ...)` measures through that handle).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from ..routing.apply import active_handle, apply_plan
from ..errors import AllocMoeError
from ..core.config import check_argument, check_model_argument, check_tokenizer_argument
from ..core.plan import Plan
from ..routing.layout import load_plan, model_fingerprint
from .engine import Engine, Request
from .prompts import chat_prompt_ids, check_token_ids, text_prompt_ids
from .sampling import SamplingParams


@dataclass
class GenerationSummary:
    prompt_tokens: int
    new_tokens: int
    finish_reason: str
    prefill_seconds: float                  # submit to first token
    decode_seconds: float                   # first token to the last
    prefill_activations_per_token: float | None
    decode_activations_per_token: float | None
    full_activations_per_token: float       # the unmodified model's, L * K_orig

    @property
    def decode_tokens_per_second(self) -> float | None:
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decode_tokens_per_second": self.decode_tokens_per_second}

    def line(self) -> str:
        def acts(value):
            return "-" if value is None else f"{value:.2f}"

        rate = self.decode_tokens_per_second
        return (f"prompt {self.prompt_tokens} tokens, {self.new_tokens} new ({self.finish_reason}); "
                f"prefill {self.prefill_seconds:.3f} s, decode {'-' if rate is None else f'{rate:.1f}'} tokens/s; "
                f"activations/token: prefill {acts(self.prefill_activations_per_token)}, "
                f"decode {acts(self.decode_activations_per_token)} of {self.full_activations_per_token:g} (full)")


class TextStream:
    """Iterate for text pieces as they are generated; afterwards `text`, `token_ids` and `summary`."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], plan: Plan | None, params: SamplingParams):
        self.model, self.tokenizer, self.prompt_ids, self.plan, self.params = model, tokenizer, prompt_ids, plan, params
        self.text, self.token_ids = "", []
        self.summary: GenerationSummary | None = None
        self._started = False

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise AllocMoeError("this generation was already iterated; call generate() again")
        self._started = True
        own = self.plan is not None
        handle = apply_plan(self.model, self.plan) if own else active_handle(self.model)
        try:
            engine = Engine(self.model, self.tokenizer, handle, max_batch_size=1, max_queue=0)
            request = engine.submit(Request(list(self.prompt_ids), self.params))
            while not request.finished:
                engine.step()
                piece = request.text.take(final=request.finished)
                if piece:
                    self.text += piece
                    yield piece
        finally:
            if own:
                handle.remove()
        if request.finish_reason == "error":
            raise RuntimeError(f"generation failed: {request.error}")
        self.token_ids = list(request.generated)
        fingerprint = model_fingerprint(self.model)
        times = request.times
        self.summary = GenerationSummary(
            prompt_tokens=len(self.prompt_ids), new_tokens=len(request.generated),
            finish_reason=request.finish_reason,
            prefill_seconds=times["first_token"] - times["submitted"],
            decode_seconds=times["finished"] - times["first_token"],
            prefill_activations_per_token=request.activations_per_token("prefill"),
            decode_activations_per_token=request.activations_per_token("decode"),
            full_activations_per_token=float(fingerprint["num_moe_layers"] * fingerprint["k_orig"]))


def generate(model, tokenizer, prompt: str | list[int] | list[dict[str, Any]],
             plan: Plan | str | os.PathLike | None = None, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             stop: tuple[str, ...] | list[str] = (), chat: bool = False,
             chat_template: str | None = None) -> TextStream:
    """Generate from `prompt` (text, token ids, or, with `chat=True`, text or a list of chat
    messages put through the chat template) under `plan` (a Plan, a plan file, or None).
    Returns a TextStream: iterate it for text pieces; `.summary` says what was spent."""
    check_model_argument("generate", model)
    check_tokenizer_argument("generate", tokenizer)
    if not isinstance(plan, (Plan, str, os.PathLike, type(None))):
        raise AllocMoeError(f"generate: plan must be a Plan, a plan file's path or None, got {type(plan).__name__}; "
                            "give one of those")
    check_argument("generate", "chat", chat, bool)
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
        raise AllocMoeError(f"generate: stop must be a list of strings, got {type(stop).__name__}; give e.g. "
                            "[\"\\n\\n\"]")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            stop=tuple(stop))
    if plan is not None and not isinstance(plan, Plan):
        plan = load_plan(plan, model)
    if plan is not None and active_handle(model) is not None:
        raise AllocMoeError("a plan is already applied to this model; pass plan=None to generate under it, "
                            "or remove its handle first")
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = chat_prompt_ids(tokenizer, messages, chat_template)
    elif isinstance(prompt, str):
        ids = text_prompt_ids(tokenizer, prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(i, int) for i in prompt):
        ids = check_token_ids(list(prompt), int(model.config.vocab_size))
    else:
        raise AllocMoeError(f"generate: prompt must be a string or a list of token ids, got "
                            f"{type(prompt).__name__}; give text or ids (chat messages need chat=True)")
    if not ids:
        raise AllocMoeError("the prompt is empty; give at least one token")
    Engine(model, tokenizer).check_fits(len(ids), params.max_new_tokens)
    return TextStream(model, tokenizer, ids, plan, params)
