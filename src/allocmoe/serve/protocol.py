"""The OpenAI-compatible request bodies the server accepts, and its error JSON.

Typed and strict: unknown fields are refused with a 400 that names them (never ignored), wrong
types are refused rather than coerced, and fields of the OpenAI API that allocmoe does not
implement are accepted only at their neutral value (`n=1`, no penalties, no logprobs), so a
client is never silently given something other than what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import AllocMoeError

MAX_STOP = 16
ON_THE_FLY_METHODS = ("alloc-moe", "alloc-l", "alloc-t", "uniform", "ascending", "descending")
# OpenAI fields allocmoe does not implement, with the one value it accepts for each
NEUTRAL = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": None, "top_logprobs": None,
           "echo": False, "best_of": None, "suffix": None, "logit_bias": None}


def _neutral(value: Any, neutral: Any) -> bool:
    return value == neutral or (neutral is None and value in (False, {}))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AllocMoeOptions(_Strict):
    """The `allocmoe` extension field: which plan routes this request."""
    plan: str | None = Field(None, description="a plan the server was started with (--plan NAME=FILE)")
    budget: float | str | None = Field(None, description="allocate a plan for this budget from --profile: "
                                       "a fraction (0.5, '1/2', '50%') or a count of activations per token")
    method: Literal[ON_THE_FLY_METHODS] = Field("alloc-moe", description="allocation method for `budget`")  # type: ignore[valid-type]


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = Field(None, description="MODEL, or MODEL@PLAN to pick a plan")
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the rest of the context)")
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = Field(None, description="up to 16 stop strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's extension: keep generating past end-of-text")
    user: str | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    allocmoe: AllocMoeOptions | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something allocmoe does not implement."""
        values = self.model_dump()
        return [f"{name}={values[name]!r}" for name, neutral in NEUTRAL.items()
                if name in values and not _neutral(values[name], neutral)]

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise AllocMoeError(f"stop has {len(stops)} strings; give at most {MAX_STOP}")
        if any(not s for s in stops):
            raise AllocMoeError("stop strings must not be empty")
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="one prompt: text or token ids (a list of several prompts is refused)")
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
            out.append({"role": m.role, "content": content or ""})
        return out


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               413: "RequestTooLarge", 415: "UnsupportedMediaType", 422: "BadRequestError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The error JSON of vLLM's and OpenAI's servers, which the openai client reads."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors -> one readable line, and the first offending field."""
    parts, first = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") in ("json_invalid", "json_type"):
            loc = []                      # pydantic gives the character offset here, not a field
        where = ".".join(loc) if loc else "body"
        first = first or (where if loc else None)
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported field {where!r} (allocmoe does not implement it; remove it)")
        elif err.get("type") == "missing":
            parts.append(f"missing field {where!r}")
        elif err.get("type") in ("json_invalid", "json_type"):
            parts.append(f"the body is not valid JSON ({err.get('msg')})")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts), first
