"""The OpenAI response shapes of one request: completion or chat, whole or chunked, with usage
(and allocmoe's measured spend) and, when asked, each new token's log-probability."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from .engine import Request


class Reply:
    def __init__(self, chat: bool, model_id: str, full: float, plan_name: str | None, tokenizer=None,
                 name_of: Callable[[int], str] = str):
        self.chat, self.model_id, self.full, self.plan_name = chat, model_id, full, plan_name
        self.name_of = name_of          # a plan's name from its index in the handle (recorded plans)
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, kind: str) -> dict[str, Any]:
        obj = {"whole": "chat.completion", "chunk": "chat.completion.chunk"}[kind] if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def usage(self, request: Request) -> dict[str, Any]:
        new = len(request.generated)
        usage = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": new,
                 "total_tokens": len(request.prompt_ids) + new,
                 "allocmoe": {"plan": self.plan_name or "full",
                              "activations_per_token": request.activations_per_token(),
                              "full_activations_per_token": self.full,
                              "prefill_activations_per_token": request.activations_per_token("prefill"),
                              "decode_activations_per_token": request.activations_per_token("decode")}}
        if request.plan_steps is not None:      # --record-plans: [plan, passes], the prefill pass first
            usage["allocmoe"]["plans"] = [[self.name_of(index), count] for index, count in request.plan_steps]
        return usage

    def whole(self, text: str, request: Request) -> dict[str, Any]:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=self.logprobs(request), finish_reason=request.finish_reason)
        return {**self.head("whole"), "choices": [choice], "usage": self.usage(request)}

    def chunk(self, piece: str | dict, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = piece if isinstance(piece, dict) else {"content": piece}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece}
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**self.head("chunk"), "choices": [choice]}

    def logprobs(self, request: Request) -> dict[str, Any] | None:
        """OpenAI's logprobs object (chat or legacy completions) for the chosen tokens; None unless asked.
        Log-probabilities are the model's own distribution, before temperature and top_p (as vLLM's)."""
        if not request.params.logprobs:
            return None
        tokens = [self.tokenizer.decode([t]) for t in request.generated]
        values = [max(lp, -9999.0) for lp in request.logprobs]        # -inf is not JSON; vLLM clamps too
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                for t, lp in zip(tokens, values)]}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, values)]}    # logprobs=0: the chosen one


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
