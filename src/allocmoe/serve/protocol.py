"""The OpenAI-compatible request bodies the server accepts, and its error JSON.

Typed and strict: unknown fields are refused with a 400 that names them (never ignored), wrong
types are refused rather than coerced, and fields of the OpenAI API that allocmoe does not
implement are accepted only at their neutral value (`n=1`, no penalties, no top logprobs), so a
client is never silently given something other than what it asked for. Text with a lone UTF-16
surrogate is refused here (no tokenizer takes it).
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ..core.budget import BUDGET_PATTERN
from ..errors import AllocMoeError

MAX_STOP = 16
MAX_MESSAGES = 10_000       # chat messages in one request, and text parts in all of them
# the serving model's context, set by the app around each request: token ids past it are refused unread
CONTEXT_TOKENS: ContextVar[int | None] = ContextVar("allocmoe_context_tokens", default=None)
ON_THE_FLY_METHODS = ("alloc-moe", "alloc-l", "alloc-t", "uniform", "ascending", "descending")
PROFILE_METHODS = ("alloc-moe", "alloc-l")     # of those, the ones that read the server's profile (as in calibrate)
# OpenAI fields allocmoe does not implement, with the values it accepts for each (logprobs: see below)
NEUTRAL = {"n": (1,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "echo": (False,),
           "best_of": (None, 1), "suffix": (None,), "logit_bias": (None, {})}


def _neutral(value: Any, neutral: tuple) -> bool:
    # a bool matches only itself: `0 in (False, {})` is true in Python, and once hid `logprobs: 0`
    return any(value is n or (not isinstance(value, bool) and not isinstance(n, bool) and value == n)
               for n in neutral)


SURROGATE = "the text holds a lone UTF-16 surrogate; send well-formed Unicode (pair each surrogate or drop it)"


def _well_formed(text: str) -> str:
    """Refuse a lone UTF-16 surrogate ("\\ud800" in JSON): no tokenizer or UTF-8 encoder takes it.
    (pydantic refuses most of them first, as `string_unicode`; this catches the rest.)"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(SURROGATE) from None
    return text


Text = Annotated[str, AfterValidator(_well_formed)]

# A budget as text: a fraction ("0.4", "1/3", "40%") or a count ("14.4"), ASCII digits, short: the
# library's documented forms (core/budget.py), checked in the request model so that a body with another
# one is a 400 before anything parses it ("1e999999999" once froze every client for hours).
BUDGET_MAX_CHARS = 32
_BUDGET_TEXT = re.compile(BUDGET_PATTERN)


def _budget_text(text: str) -> str:
    if len(text) > BUDGET_MAX_CHARS or not _BUDGET_TEXT.fullmatch(text):
        raise ValueError(f"the budget is not a number in a form the server reads: give a fraction of the full "
                         f"budget (0.4, \"1/3\", \"40%\") or a count of activations per token (14.4), in ASCII "
                         f"digits, at most {BUDGET_MAX_CHARS} characters")
    return text


BudgetText = Annotated[str, AfterValidator(_budget_text),
                       Field(json_schema_extra={"pattern": BUDGET_PATTERN, "maxLength": BUDGET_MAX_CHARS})]
Prompt = Annotated[str, Field(min_length=1), AfterValidator(_well_formed)]
TokenIds = Annotated[list[Annotated[int, Field(json_schema_extra={"minimum": 0})]], Field(min_length=1)]
Stop = Annotated[str, AfterValidator(_well_formed), Field(json_schema_extra={"minLength": 1})]  # server's message
ONE = {"maxItems": 1}           # in the schema; the server refuses more with its own message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AllocMoeOptions(_Strict):
    """The `allocmoe` extension field: which plan routes this request."""
    plan: Text | None = Field(None, description="a plan the server was started with (--plan NAME=FILE)")
    budget: float | BudgetText | None = Field(None, description="allocate a plan for this budget from --profile: "
                                       "a fraction (0.5, '1/2', '50%') or a count of activations per token")
    method: Literal[ON_THE_FLY_METHODS] = Field("alloc-moe", description="allocation method for `budget`")  # type: ignore[valid-type]
    min_budget: float | BudgetText | None = Field(None, description="on an elastic server (--latency-target-ms): "
                                                  "the least budget this request accepts under load")
    elastic: bool = Field(True, description="false: run at the full model even when an elastic server is busy")


class StreamOptions(_Strict):
    include_usage: bool = False


def _bounded(body: Any) -> Any:
    """Refuse, before pydantic walks them, the long lists that would cost it seconds. Validation runs on
    the event loop (and would hold the GIL off it): a 2 MB `prompt` of 400 000 one-id lists took 3.5 s
    there, every other client waiting, and 400 000 floats as token ids made 1.2 million errors."""
    if not isinstance(body, dict):
        return body
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise ValueError(f"prompt holds {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        context = CONTEXT_TOKENS.get()
        if context is not None and len(prompt) > context:     # 2 million ids held the loop 2.8 s
            raise ValueError(f"the prompt has {len(prompt)} tokens, but the model's context is {context} tokens; "
                             "shorten the prompt")
        bad = next((i for i, x in enumerate(prompt) if type(x) is not int), None)    # bool is not an id
        if bad is not None and not (bad == 0 and isinstance(prompt[0], (list, str))):
            raise ValueError(f"prompt: token ids must be integers; item {bad} is a {type(prompt[bad]).__name__}")
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise ValueError(f"stop has {len(stop)} strings; give at most {MAX_STOP}")
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise ValueError(f"messages holds {len(messages)} messages; send at most {MAX_MESSAGES}")
        parts = sum(len(c) for c in (m.get("content") if isinstance(m, dict) else None for m in messages)
                    if isinstance(c, list))
        if parts > MAX_MESSAGES:
            raise ValueError(f"messages hold {parts} content parts; send at most {MAX_MESSAGES} in all "
                             "(or each content as one string)")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and bias:
        raise ValueError(f"unsupported: logit_bias with {len(bias)} entries (allocmoe does not implement it); "
                         "remove it")
    return body


class _Sampling(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, body: Any) -> Any:
        return _bounded(body)

    model: Text | None = Field(None, description="MODEL, or MODEL@PLAN to pick a plan")
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the rest of the context)")
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Stop | Annotated[list[Stop], Field(json_schema_extra={"maxItems": MAX_STOP})] | None = Field(
        None, description="up to 16 stop strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's extension: keep generating past end-of-text")
    user: Text | None = None
    n: int = Field(1, ge=1, json_schema_extra={"maximum": 1})
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[Text, float] | None = None
    allocmoe: AllocMoeOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options applies only with stream: true; set stream or drop stream_options")
        return self

    def unsupported(self) -> list[str]:
        """Fields set to something allocmoe does not implement."""
        values = self.model_dump()
        found = [f"{name}={values[name]!r}" for name, neutral in NEUTRAL.items()
                 if name in values and not _neutral(values[name], neutral)]
        if self.top_alternatives():
            found.append(f"{'logprobs' if isinstance(self, CompletionRequest) else 'top_logprobs'}="
                         f"{self.top_alternatives()} (top alternatives; ask for 0)")
        if self.stream and self.wants_logprobs():
            found.append("logprobs with stream=true (ask for logprobs without streaming)")
        return found

    def wants_logprobs(self) -> bool:
        return False

    def top_alternatives(self) -> int:
        return 0

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise AllocMoeError(f"stop has {len(stops)} strings; give at most {MAX_STOP}")
        if any(not s for s in stops):
            raise AllocMoeError("stop strings must not be empty")
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: Prompt | TokenIds | Annotated[list[Prompt], Field(min_length=1, json_schema_extra=ONE)] | \
        Annotated[list[TokenIds], Field(min_length=1, json_schema_extra=ONE)] = Field(
        ..., description="one prompt: text or token ids (a list of several prompts is refused)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, json_schema_extra={"maximum": 0},
                                 description="0: each new token's log-probability (no top alternatives)")
    best_of: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1})
    suffix: Text | None = None

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_alternatives(self) -> int:
        return self.logprobs or 0


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(None, description="the speaker's name, passed to the chat template (as vLLM does)")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="true: each new token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, json_schema_extra={"maximum": 0},
                                     description="0 only: top alternatives are not implemented")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true; set it or drop top_logprobs")
        return self

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def top_alternatives(self) -> int:
        return self.top_logprobs or 0

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = (m.content if isinstance(m.content, str) or m.content is None
                       else "".join(p.text for p in m.content))
            message = {"role": m.role, "content": content or ""}
            if m.name is not None:
                message["name"] = m.name          # as vLLM: the template decides what to do with it
            out.append(message)
        return out


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               408: "RequestTimeout", 413: "RequestTooLarge", 415: "UnsupportedMediaType", 422: "BadRequestError",
               429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


MAX_MESSAGE_CHARS = 1000


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The error JSON of vLLM's and OpenAI's servers, which the openai client reads. Text that came
    from the client (a field name, say) may hold a lone surrogate: it is escaped, never a 500. And it
    may be megabytes long (a `suffix`, a `model`, an unknown field's name): shortened, not echoed whole."""
    return {"error": {"message": _printable(message), "type": ERROR_TYPES.get(status, "Error"),
                      "param": None if param is None else _printable(param), "code": status}}


def _printable(text: str) -> str:
    if len(text) > MAX_MESSAGE_CHARS:
        text = f"{text[:MAX_MESSAGE_CHARS]}...({len(text) - MAX_MESSAGE_CHARS} more characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# pydantic's error types that mean "not this type" (in a union, the branches the input did not take)
WRONG_TYPE = {"string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type", "model_type",
              "model_attributes_type", "int_from_float", "literal_error", "is_instance_of"}


def _is_tag(part: Any) -> bool:
    """A union member's tag in an error's location ('list[int]', 'function-after[...]', 'str')."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "constrained-str"))


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors -> one readable line, and the first offending field. A union's branches
    are folded into one entry per field: the branch whose type the input had, when one had it."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_tag(x)]
        if err.get("type") in ("json_invalid", "json_type"):
            loc = []                      # pydantic gives the character offset here, not a field
        groups.setdefault(".".join(loc), []).append(err)
    parts, first = [], None
    for where, errs in list(groups.items())[:5]:
        first = first or (where or None)
        kind = errs[0].get("type")
        right_type = [e for e in errs if e.get("type") not in WRONG_TYPE]
        msgs = list(dict.fromkeys(SURROGATE if e.get("type") == "string_unicode" else
                                  str(e.get("msg", "")).removeprefix("Value error, ") for e in (right_type or errs)))
        if not where and kind == "missing":
            parts.append("the request body is empty; send a JSON object")
        elif not where and kind in ("model_attributes_type", "dict_type", "model_type"):
            parts.append("the request body must be a JSON object ({...}), not an array, a string, a number or null")
        elif kind == "extra_forbidden":
            parts.append(f"unsupported field {where!r} (allocmoe does not implement it; remove it)")
        elif kind == "missing":
            parts.append(f"missing field {where!r}")
        elif kind in ("json_invalid", "json_type"):
            parts.append(f"the body is not valid JSON ({errs[0].get('msg')})")
        elif not where:
            parts.append("; ".join(msgs))
        elif right_type or len(msgs) == 1:
            parts.append(f"{where}: {msgs[0]}")
        else:
            parts.append(f"{where}: wrong type ({' / '.join(msgs)}; see /openapi.json)")
    return "; ".join(parts), first
