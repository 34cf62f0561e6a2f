"""The OpenAI-compatible HTTP server: FastAPI routes over one engine thread.

    app = create_app(model, tokenizer, ServerConfig(model_name="allocmoe-builtin", plans={"half": plan}))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: GET /health, GET /v1/models, GET /metrics, POST /v1/completions, POST /v1/chat/completions.
A request picks its plan by `"model": "MODEL@NAME"`, by `"allocmoe": {"plan": NAME}`, or by
`"allocmoe": {"budget": 0.4}` when the server has a profile; none means the full model.

The engine runs in its own thread; a request hands it a `Request` whose `on_update` callback pushes
each settled text piece onto the request's asyncio queue (`call_soon_threadsafe`). Every error a
client can cause is a 4xx with the OpenAI error JSON; a client that goes away cancels its request,
which frees its batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import AllocMoeError
from ..core.plan import Plan
from .engine import Engine, QueueFull, Request
from .metrics import CONTENT_TYPE, ServerMetrics
from .plans import PlanRegistry, UnknownPlan
from .prompts import chat_prompt_ids, check_token_ids, text_prompt_ids
from .protocol import ChatCompletionRequest, CompletionRequest, describe_validation_errors, error_body
from .sampling import SamplingParams

log = logging.getLogger("allocmoe.serve")
DISCONNECT_POLL_S = 0.5          # how often a waiting non-streaming request checks its client is still there


@dataclass
class ServerConfig:
    model_name: str = "allocmoe-builtin"            # the id /v1/models lists; plans are MODEL@NAME
    plans: dict[str, Plan] = field(default_factory=dict)   # NAME -> plan, chosen per request
    profile: dict[str, Any] | None = None           # lets a request ask for a budget (plan made on the fly)
    max_batch_size: int = 8                         # rows per forward pass: more = throughput, fewer = latency
    max_queue: int = 64                             # waiting requests beyond this get 503 + Retry-After
    api_key: str | None = None                      # when set, /v1 routes need `Authorization: Bearer KEY`
    chat_template: str | None = None                # Jinja text overriding the tokenizer's chat template
    max_model_len: int | None = None                # prompt + new tokens at most (default: the model's context)
    max_budget_plans: int = 32                      # distinct on-the-fly budgets kept (each is a plan in memory)


class Server:
    """What the routes share: the plans, the engine and its thread, the metrics."""

    def __init__(self, model, tokenizer, config: ServerConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.metrics = ServerMetrics()
        self.registry = PlanRegistry(model, config.model_name, config.plans, config.profile,
                                     max_budget_plans=config.max_budget_plans)
        try:
            self.engine = Engine(model, tokenizer, self.registry.handle, config.max_batch_size, config.max_queue,
                                 on_pass=self.metrics.on_pass, max_model_len=config.max_model_len)
        except BaseException:
            self.registry.close()
            raise
        self.metrics.full_activations.set(self.registry.full_budget)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.engine.serve_forever, name="allocmoe-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.engine.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.registry.close()


def create_app(model, tokenizer, config: ServerConfig | None = None) -> FastAPI:
    server = Server(model, tokenizer, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            server.close()

    app = FastAPI(title="allocmoe", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions with a per-request activation budget.")
    app.state.server = server
    _add_error_handlers(app, server)

    @app.middleware("http")
    async def check_api_key(request: HTTPRequest, call_next):
        key = server.config.api_key
        if key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                server.metrics.requests.labels("none", "401").inc()
                return JSONResponse(error_body(401, "missing or wrong API key: send 'Authorization: Bearer KEY'"),
                                    status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(*server.engine.load()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": model_id, "object": "model", "created": server.created, "owned_by": "allocmoe",
                 "root": server.config.model_name, "parent": None if name is None else server.config.model_name,
                 "max_model_len": server.engine.context_len,
                 "allocmoe": {"plan": name or "full", "method": plan.method, "budget": plan.budget,
                              "full_budget": plan.full_budget}}
                for model_id, name, plan in server.registry.model_ids()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        return await _generate(server, raw, body, _completion_prompt(server, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest):
        ids = chat_prompt_ids(server.tokenizer, body.chat_messages(), server.config.chat_template)
        return await _generate(server, raw, body, ids, chat=True)

    return app


# -- one generation ---------------------------------------------------------------------------
class _Updates:
    """The engine thread's updates of one request, as an asyncio queue of (text piece, finished)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, request: Request) -> None:          # runs in the engine thread
        piece = request.text.take(final=request.finished)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (piece, request.finished))
        except RuntimeError:                                 # the loop is gone (server shutting down)
            pass


async def _generate(server: Server, raw: HTTPRequest, body, prompt_ids: list[int], chat: bool):
    unsupported = body.unsupported()
    if unsupported:
        raise AllocMoeError(f"unsupported: {', '.join(unsupported)} (allocmoe implements one choice, no "
                            "penalties, no logprobs); remove them")
    opts = body.allocmoe
    index, plan_name = server.registry.resolve(body.model, opts and opts.plan, opts and opts.budget,
                                               opts.method if opts else "alloc-moe")
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    room = server.engine.context_len - len(prompt_ids)
    params = SamplingParams(max_new_tokens=limit if limit is not None else max(room, 1),
                            temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            stop=body.stop_strings(), ignore_eos=body.ignore_eos)
    updates = _Updates(asyncio.get_running_loop())
    request = server.engine.submit(Request(prompt_ids, params, plan_index=index, on_update=updates))
    model_id = server.config.model_name if plan_name is None else f"{server.config.model_name}@{plan_name}"
    reply = _Reply(chat, model_id, server.registry.full_budget, plan_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(server, request, updates, reply, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text = []
    while True:
        try:
            piece, done = await asyncio.wait_for(updates.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await raw.is_disconnected():
                server.engine.cancel(request)
                _record(server, request, plan_name, "499")
                return Response(status_code=499)
            continue
        text.append(piece)
        if done:
            break
    if request.finish_reason == "error":
        _record(server, request, plan_name, "500")
        log.error("generation failed: %s", request.error)
        return JSONResponse(error_body(500, f"generation failed: {request.error}"), status_code=500)
    _record(server, request, plan_name, "200")
    return reply.whole("".join(text), request)


async def _stream(server: Server, request: Request, updates: _Updates, reply: "_Reply",
                  include_usage: bool) -> AsyncIterator[str]:
    status = "499"                         # until the stream ends normally: the client went away
    try:
        if reply.chat:
            yield _sse(reply.chunk({"role": "assistant", "content": ""}, None))
        while True:
            piece, done = await updates.queue.get()
            if piece:
                yield _sse(reply.chunk(piece, None))
            if done:
                break
        if request.finish_reason == "error":
            status = "500"
            yield _sse(error_body(500, f"generation failed: {request.error}"))
        else:
            status = "200"
            yield _sse(reply.chunk("" if not reply.chat else {}, request.finish_reason))
            if include_usage:
                yield _sse({**reply.head("chunk"), "choices": [], "usage": reply.usage(request)})
        yield "data: [DONE]\n\n"
    finally:
        if not request.finished:
            server.engine.cancel(request)
        _record(server, request, reply.plan_name, status)


class _Reply:
    """The OpenAI response shapes of one request (completion or chat; whole or chunked)."""

    def __init__(self, chat: bool, model_id: str, full: float, plan_name: str | None):
        self.chat, self.model_id, self.full, self.plan_name = chat, model_id, full, plan_name
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, kind: str) -> dict[str, Any]:
        obj = {"whole": "chat.completion", "chunk": "chat.completion.chunk"}[kind] if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def usage(self, request: Request) -> dict[str, Any]:
        new = len(request.generated)
        return {"prompt_tokens": len(request.prompt_ids), "completion_tokens": new,
                "total_tokens": len(request.prompt_ids) + new,
                "allocmoe": {"plan": self.plan_name or "full",
                             "activations_per_token": request.activations_per_token(),
                             "full_activations_per_token": self.full,
                             "prefill_activations_per_token": request.activations_per_token("prefill"),
                             "decode_activations_per_token": request.activations_per_token("decode")}}

    def whole(self, text: str, request: Request) -> dict[str, Any]:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=None, finish_reason=request.finish_reason)
        return {**self.head("whole"), "choices": [choice], "usage": self.usage(request)}

    def chunk(self, piece: str | dict, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = piece if isinstance(piece, dict) else {"content": piece}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece}
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**self.head("chunk"), "choices": [choice]}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _record(server: Server, request: Request, plan_name: str | None, status: str) -> None:
    plan = plan_name or "full"
    times = request.times
    server.metrics.requests.labels(plan, status).inc()
    server.metrics.finished(
        plan, request.prefill_tokens, len(request.generated),
        request.prefill_activations + request.decode_activations, request.prefill_tokens + request.decode_tokens,
        ttft=times["first_token"] - times["submitted"] if "first_token" in times else None,
        latency=times["finished"] - times["submitted"] if "finished" in times else None)


def _completion_prompt(server: Server, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise AllocMoeError(f"prompt holds {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_prompt_ids(server.tokenizer, prompt)
    return check_token_ids(list(prompt), int(server.model.config.vocab_size))


# -- errors -----------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI, server: Server) -> None:
    def refuse(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
        server.metrics.requests.labels("none", str(status)).inc()
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return refuse(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return refuse(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(UnknownPlan)
    async def unknown_plan(_, exc: UnknownPlan):
        return refuse(404, str(exc), "model")

    @app.exception_handler(QueueFull)
    async def queue_full(_, exc: QueueFull):
        return refuse(503, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(AllocMoeError)
    async def bad_input(_, exc: AllocMoeError):
        return refuse(400, str(exc))

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        log.exception("internal error")
        return refuse(500, f"internal error ({type(exc).__name__}); see the server log")


def _version() -> str:
    from .. import __version__

    return __version__
