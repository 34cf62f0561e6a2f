"""The OpenAI-compatible HTTP server: FastAPI routes over one engine thread.

    app = create_app(model, tokenizer, ServerConfig(model_name="allocmoe-builtin", plans={"half": plan}))
    allocmoe.serve.http.run(app, "127.0.0.1", 8000, HTTPLimits())   # uvicorn, with the limits of http.py

Routes: GET /health, GET /v1/models, GET /metrics, POST /v1/completions, POST /v1/chat/completions.
A request picks its plan by `"model": "MODEL@NAME"`, by `"allocmoe": {"plan": NAME}`, or by
`"allocmoe": {"budget": 0.4}` when the server was handed an allocate function (ServerConfig.allocate,
allocmoe.allocate from the command line; alloc-moe and alloc-l need its profile too); none means the
full model.

The engine runs in its own thread; a request hands it a `Request` whose `on_update` callback pushes
each settled text piece onto the request's asyncio queue (`call_soon_threadsafe`). Every error a
client can cause is a 4xx with the OpenAI error JSON; a client that goes away cancels its request,
which frees its batch slot at the next step (counted 499). Tokenizing and allocating a plan run in
a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..errors import AllocMoeError
from ..core.budget import Budget
from ..core.plan import Plan
from .elastic import DEFAULT_LADDER, Elastic, make_ladder
from .engine import Engine, QueueFull, Request
from .http import Guard, HTTPLimits
from .metrics import CONTENT_TYPE, ServerMetrics
from .openapi import error_responses, METRICS_RESPONSES, generation_responses, tidy_openapi
from .plans import Allocate, PlanRegistry, UnknownPlan
from .prompts import chat_prompt_ids, check_token_ids, longest_token, text_prompt_ids
from .protocol import (CONTEXT_TOKENS, ChatCompletionRequest, CompletionRequest, describe_validation_errors,
                       error_body)
from .replies import Reply, sse
from .sampling import SamplingParams

log = logging.getLogger("allocmoe.serve")


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
    max_budget_plans: int = 32                      # on-the-fly budget plans kept (least recently used go first)
    allocate: Allocate | None = None                # makes a requested budget's plan (allocmoe.allocate); None: refused
    limits: HTTPLimits = field(default_factory=HTTPLimits)   # body size, timeouts, connections, shutdown
    latency_target_ms: float | None = None          # decode step time to hold under load by stepping down the ladder
    ladder: tuple[str, ...] = DEFAULT_LADDER        # budgets below full allocated from `profile` for that ladder
    record_plans: bool = False                      # return each request's plan per pass (usage.allocmoe.plans)
    clock: Callable[[], float] = time.perf_counter  # times each pass; tests hand a deterministic one


class Server:
    """What the routes share: the plans, the engine and its thread, the metrics."""

    def __init__(self, model, tokenizer, config: ServerConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.metrics = ServerMetrics()
        self.registry = PlanRegistry(model, config.model_name, config.plans, config.profile,
                                     max_budget_plans=config.max_budget_plans, on_evict=self.metrics.forget,
                                     allocate=config.allocate)
        self.elastic: Elastic | None = None
        try:
            on_pass, choose = self.metrics.on_pass, None
            if config.latency_target_ms is not None:
                self.elastic = Elastic(make_ladder(self.registry, config.ladder), config.latency_target_ms / 1000,
                                       on_step=lambda rung, step: self.metrics.elastic_step(
                                           rung.activations, step.predicted, step.measured))
                self.metrics.elastic_target.set(self.elastic.target)
                self.metrics.elastic_budget.set(self.registry.full_budget)
                on_pass, choose = self._on_pass, self.elastic.choose_plans
            self.engine = Engine(model, tokenizer, self.registry.handle, config.max_batch_size, config.max_queue,
                                 on_pass=on_pass, max_model_len=config.max_model_len, choose_plans=choose,
                                 clock=config.clock, record_plans=config.record_plans)
        except BaseException:
            self.registry.close()
            raise
        longest_token(tokenizer)                    # computed once, here, not in the first request
        self.metrics.full_activations.set(self.registry.full_budget)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._deadline: threading.Timer | None = None

    def _on_pass(self, stats) -> None:
        self.metrics.on_pass(stats)
        self.elastic.observe(stats)

    def plan_name(self, index: int) -> str:
        """The name usage and metrics give the plan at `index` in the handle."""
        return self.registry.names[index] or "full"

    def elastic_floor(self, opts, plan_name: str | None) -> int | None:
        """The poorest ladder rung a request accepts, or None: it keeps the plan it resolved to."""
        floor = opts.min_budget if opts is not None else None
        if floor is not None:
            if plan_name is not None:
                raise AllocMoeError("min_budget applies to requests the server may step down under load; this "
                                    "one names a plan or a budget, which it keeps: drop one of them")
            if not opts.elastic:
                raise AllocMoeError("min_budget applies only to elastic requests; drop it or elastic: false")
            if isinstance(floor, bool):
                raise AllocMoeError("allocmoe.min_budget must be a number or a string such as '1/2'")
            floor = Budget.parse(str(floor), self.registry.num_layers, self.registry.k_orig).activations_per_token
        if self.elastic is None or plan_name is not None or (opts is not None and not opts.elastic):
            return None
        return self.elastic.floor(floor)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.engine.serve_forever, name="allocmoe-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests now; fail what still runs after `shutdown_timeout` seconds, so
        every open stream ends with an error event instead of holding the shutdown up."""
        if self._deadline is not None:
            return
        timeout = self.config.limits.shutdown_timeout
        running, waiting = self.engine.load()
        log.info("shutting down: %d running, %d waiting requests get %g s to finish", running, waiting, timeout)
        self.engine.drain()
        self._deadline = threading.Timer(timeout, self.engine.abort, (
            f"the server shut down before this generation finished (--shutdown-timeout {timeout:g} s); "
            "send the request again",))
        self._deadline.daemon = True
        self._deadline.start()

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
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

    # redirect_slashes off: Starlette answered POST /v1/completions/ with a 307 to http://<the client's
    # Host header>/v1/completions, an empty-bodied redirect to wherever the client said it was
    app = FastAPI(title="allocmoe", version=_version(), lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible completions with a per-request activation budget.")
    app.state.server = server
    _add_error_handlers(app, server)
    app.add_middleware(Guard, limits=server.config.limits, api_key=lambda: server.config.api_key,
                       on_refuse=lambda status: server.metrics.requests.labels("none", str(status)).inc())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return Response(server.metrics.render(*server.engine.load()), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> dict[str, Any]:
        data = [{"id": model_id, "object": "model", "created": server.created, "owned_by": "allocmoe",
                 "root": server.config.model_name, "parent": None if name is None else server.config.model_name,
                 "max_model_len": server.engine.context_len,
                 "allocmoe": {"plan": name or "full", "method": plan.method, "budget": plan.budget,
                              "full_budget": plan.full_budget, "cost": plan.cost()}}
                for model_id, name, plan in server.registry.model_ids()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions", responses=generation_responses("text_completion"))
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        return await _generate(server, raw, body, lambda: _completion_prompt(server, body), chat=False)

    @app.post("/v1/chat/completions", responses=generation_responses("chat.completion"))
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest):
        return await _generate(server, raw, body, lambda: chat_prompt_ids(
            server.tokenizer, body.chat_messages(), server.config.chat_template, server.engine.context_len),
            chat=True)

    app.add_middleware(_RequestContext, context_tokens=server.engine.context_len)
    tidy_openapi(app)
    return app


class _RequestContext:
    """ASGI middleware: what request validation needs to know of this server (its context, so a list of
    token ids longer than it is refused before it is validated item by item on the event loop)."""

    def __init__(self, app, context_tokens: int):
        self.app, self.context_tokens = app, context_tokens

    async def __call__(self, scope, receive, send) -> None:
        token = CONTEXT_TOKENS.set(self.context_tokens)
        try:
            await self.app(scope, receive, send)
        finally:
            CONTEXT_TOKENS.reset(token)


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

    async def text(self) -> str:
        """Every piece, joined, once the request has finished."""
        parts = []
        while True:
            piece, done = await self.queue.get()
            parts.append(piece)
            if done:
                return "".join(parts)


async def _generate(server: Server, raw: HTTPRequest, body, prompt, chat: bool):
    unsupported = body.unsupported()
    if unsupported:
        raise AllocMoeError(f"unsupported: {', '.join(unsupported)} (allocmoe implements one choice, no "
                            "penalties, no top logprobs); remove them")
    # off the event loop: tokenizing a long prompt, and allocating a plan for a new budget, take
    # long enough to stall every other client (issue 39: 2.3 s for a 1 MB prompt, 0.2-0.5 s a plan)
    prompt_ids = await run_in_threadpool(prompt)
    opts = body.allocmoe
    index, plan_name = await run_in_threadpool(server.registry.resolve, body.model, opts and opts.plan,
                                               opts and opts.budget, opts.method if opts else "alloc-moe")
    try:
        elastic, request, updates = _submit(server, body, prompt_ids, index, plan_name)
    except BaseException:
        server.registry.release(index)
        raise
    model_id = server.config.model_name if plan_name is None else f"{server.config.model_name}@{plan_name}"
    if elastic is not None:
        plan_name = "elastic"           # usage and metrics: the plan changed with the load
    reply = Reply(chat, model_id, server.registry.full_budget, plan_name, server.tokenizer, server.plan_name)
    ended = False

    def end(status: str) -> None:          # once per request, whichever way it ends
        nonlocal ended
        if ended:
            return
        ended = True
        if not request.finished:
            server.engine.cancel(request)
        if status == "499":
            log.info("%s: the client went away; cancelled after %d tokens (499)", request.id, len(request.generated))
        _record(server, request, plan_name, status)
        server.registry.release(index)      # after its metrics: a plan no request holds may be evicted, and forgotten

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # the background task ends a stream whose generator never started (a client gone at once)
        return StreamingResponse(_stream(server, request, updates, reply, include_usage, end),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(end, "499"))
    status = "499"                         # until the reply is made: the client went away
    try:
        text = await _unless_disconnected(updates.text(), raw)
        if text is None:
            return Response(status_code=499)
        if request.finish_reason == "error":
            status = "503" if server.engine.draining else "500"
            log.error("%s: generation failed: %s", request.id, request.error)
            return JSONResponse(error_body(int(status), f"generation failed: {request.error}"), status_code=int(status))
        status = "200"
        return reply.whole(text, request)
    finally:
        end(status)


def _submit(server: Server, body, prompt_ids: list[int], index, plan_name):
    """Queue one request on the engine: (its elastic floor or None, the request, its updates)."""
    elastic = server.elastic_floor(body.allocmoe, plan_name)
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    room = server.engine.context_len - len(prompt_ids)
    params = SamplingParams(max_new_tokens=limit if limit is not None else max(room, 1),
                            temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                            stop=body.stop_strings(), ignore_eos=body.ignore_eos,
                            logprobs=body.wants_logprobs())
    updates = _Updates(asyncio.get_running_loop())
    request = server.engine.submit(Request(prompt_ids, params, plan_index=index, on_update=updates,
                                           elastic=elastic))
    return elastic, request, updates


async def _unless_disconnected(work, raw: HTTPRequest):
    """`await work`, unless the client disconnects first: then None (and `work` is cancelled)."""
    async def disconnected():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _stream(server: Server, request: Request, updates: _Updates, reply: Reply, include_usage: bool,
                  end) -> AsyncIterator[str]:
    status = "499"                         # until the stream ends normally: the client went away
    try:
        if reply.chat:
            yield sse(reply.chunk({"role": "assistant", "content": ""}, None))
        while True:
            piece, done = await updates.queue.get()
            if piece:
                yield sse(reply.chunk(piece, None))
            if done:
                break
        if request.finish_reason == "error":
            status = "503" if server.engine.draining else "500"
            yield sse(error_body(int(status), f"generation failed: {request.error}"))
        else:
            status = "200"
            yield sse(reply.chunk("" if not reply.chat else {}, request.finish_reason))
            if include_usage:
                yield sse({**reply.head("chunk"), "choices": [], "usage": reply.usage(request)})
        yield "data: [DONE]\n\n"
    finally:
        end(status)


def _record(server: Server, request: Request, plan_name: str | None, status: str) -> None:
    plan = plan_name or "full"
    times = request.times
    server.metrics.count(plan, status)
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
        return text_prompt_ids(server.tokenizer, prompt, max_tokens=server.engine.context_len)
    if len(prompt) >= server.engine.context_len:
        server.engine.check_fits(len(prompt), 1)        # the context's own message, before checking each id
    return check_token_ids(list(prompt), int(server.model.config.vocab_size))


# -- errors -----------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI, server: Server) -> None:
    def refuse(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
        server.metrics.requests.labels("none", str(status)).inc()
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError):
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            # FastAPI does not read such a body as JSON; pydantic's "Input should be a valid dictionary"
            # said nothing of why
            return refuse(400, f"the body's Content-Type is {content_type or 'missing'!r}; send the body as "
                               "JSON with 'Content-Type: application/json'")
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
    # any other exception: a 500 JSON from http.Guard, logged once


def _version() -> str:
    from ..version import __version__

    return __version__
