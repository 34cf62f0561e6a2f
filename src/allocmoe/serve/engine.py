"""Continuous batching on a transformers model, each row routed by its own request's plan.

The engine keeps one batched KV cache for the running requests, left-padded so every row ends at
the same column. Each `step()`:
  1. drops cancelled requests (their slots free at once);
  2. admits waiting requests while slots are free: their prompts are prefilled together in one
     forward pass (left-padded), and their caches are appended to the running batch;
  3. runs one decode step for every running request (one token per row), samples each row with
     its own parameters, and retires the rows that finished.
So a request that arrives mid-generation joins the batch at the next decode step.

Rows are routed by their own plan through `PlanHandle.context.row_plans` (see apply.py): a pass
whose rows follow different plans is one forward pass, and each row's routing is what it would be
alone, because the per-token policies decide a count per token and Alloc-T pools per sequence here.
The one exception by design is a distinct-expert budget (`distinct`): it chooses the experts of a
whole step, so a row's routing depends on the other rows of its plan in that step (each plan's rows
stay within their own M; rows of different plans are selected apart).
Padding never enters the pools or the counts (the attention mask marks it), and positions come
from each row's own real tokens, so left padding does not shift them.

Shape legend: B = rows in the batch, L = cache columns (padding included), P = prompt columns.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..routing.apply import PlanHandle
from ..errors import AllocMoeError
from .sampling import SamplingParams, next_token
from .text import IncrementalText


class QueueFull(AllocMoeError):
    """The waiting queue holds `max_queue` requests already (HTTP 503)."""


class ShuttingDown(QueueFull):
    """The server is draining for shutdown and takes no new requests (HTTP 503)."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    plan_index: int = 0                         # which installed plan routes this request's row
    # an elastic request (--latency-target-ms): the engine's `choose_plans` may change plan_index at every
    # pass, down to this rung of the server's ladder (its min_budget); None: the request keeps its plan
    elastic: int | None = None
    on_update: Callable[["Request"], None] | None = None   # called (engine thread) after each token and at the end
    id: str = ""
    # -- filled in by the engine --------------------------------------------------------------
    text: IncrementalText | None = None
    generator: torch.Generator | None = field(default=None, repr=False)   # this request's sampling stream
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # of each generated token, when params.logprobs
    finish_reason: str | None = None            # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    cancelled: bool = False
    prefill_activations: float = 0.0            # routed (token, expert) pairs over all MoE layers
    prefill_tokens: int = 0
    decode_activations: float = 0.0
    decode_tokens: int = 0
    times: dict[str, float] = field(default_factory=dict)   # submitted, first_token, finished (perf_counter)
    plan_steps: list[list[int]] | None = None   # with record_plans: [plan index, passes] run-length, prefill first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def activations_per_token(self, phase: str | None = None) -> float | None:
        """Measured activations per routed token: prefill, decode, or both (None)."""
        acts = {"prefill": self.prefill_activations, "decode": self.decode_activations}
        toks = {"prefill": self.prefill_tokens, "decode": self.decode_tokens}
        a = sum(acts.values()) if phase is None else acts[phase]
        t = sum(toks.values()) if phase is None else toks[phase]
        return a / t if t else None


@dataclass
class StepStats:
    """What the last forward pass was, for metrics."""
    kind: str                   # "prefill" | "decode"
    rows: int
    plans: int                  # distinct plans among the rows
    seconds: float = 0.0        # the pass's time by the engine's clock (the model's forward only)
    # decode: from the end of the previous decode pass to the end of this one, for rows running in both:
    # their time per output token, with the prefill pass, sampling and retiring between (None: first after idle)
    interval: float | None = None


class Engine:
    """Runs requests to completion in batches. Not thread-safe except `submit`, `cancel` and
    `serve_forever` / `stop`, which the server calls from other threads."""

    def __init__(self, model, tokenizer, handle: PlanHandle | None = None, max_batch_size: int = 8,
                 max_queue: int = 64, on_pass: Callable[[StepStats], None] | None = None,
                 max_model_len: int | None = None,
                 choose_plans: Callable[[list[Request], str, int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, record_plans: bool = False):
        if max_batch_size < 1 or max_queue < 0:
            raise AllocMoeError("max batch size must be >= 1 and max queue >= 0")
        self.model, self.tokenizer, self.handle = model, tokenizer, handle
        self.max_batch_size, self.max_queue, self.on_pass = max_batch_size, max_queue, on_pass
        # called before each pass with (its rows, "prefill" | "decode", the rows of the batch after it): may set plan_index
        self.choose_plans = choose_plans
        self.clock = clock                  # times each pass (StepStats.seconds); tests hand a deterministic one
        self.record_plans = record_plans    # keep each request's plan per pass (Request.plan_steps)
        model_len = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        if max_model_len is not None and not 2 <= max_model_len <= model_len:
            raise AllocMoeError(f"max model len {max_model_len} must lie between 2 and the model's context "
                                f"of {model_len} tokens")
        self.context_len = max_model_len or model_len     # prompt + new tokens, at most
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.full_activations = None
        if handle is not None:
            self.full_activations = float(handle.plans[0].full_budget)
            handle.context.track_rows = True
        self.device = next(model.parameters()).device
        # transformers >= 5.2x names the KV cache `cache`; 5.19 (the vLLM environment's) `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._waiting: deque[Request] = deque()
        self._rows: list[Request] = []
        self._cache = None
        self._mask: torch.Tensor | None = None   # [B, L] 1 = real token
        self._lock = threading.Condition()
        self._stopping = False
        self._draining = False
        self._abort: str | None = None          # set: fail every request with this message at the next step
        self._ids = itertools.count()
        self._last_decode: float | None = None   # the clock at the end of the last decode pass of a running batch

    # -- submitting (any thread) -------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise AllocMoeError("the prompt is empty; send at least one token")
        if prompt_len >= self.context_len:
            raise AllocMoeError(f"the prompt has {prompt_len} tokens, but the model's context is "
                                f"{self.context_len} tokens; shorten the prompt")
        if prompt_len + max_new_tokens > self.context_len:
            raise AllocMoeError(f"the prompt's {prompt_len} tokens plus max_tokens={max_new_tokens} exceed the "
                                f"model's context of {self.context_len} tokens; ask for at most "
                                f"{self.context_len - prompt_len} new tokens")

    def submit(self, request: Request) -> Request:
        self.check_fits(len(request.prompt_ids), request.params.max_new_tokens)
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down; retry on another server or later")
            free_slots = max(0, self.max_batch_size - len(self._rows))
            if len(self._waiting) >= self.max_queue + free_slots:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting); retry later")
            request.id = request.id or f"req-{next(self._ids)}"
            request.text = IncrementalText(self.tokenizer, request.params.stop)
            request.generator = request.params.generator()
            if self.record_plans:
                request.plan_steps = []
            request.times["submitted"] = time.perf_counter()
            self._waiting.append(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stop generating for `request` (a client went away); its slot frees at the next step."""
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    def drain(self) -> None:
        """Take no new requests (503); the running and waiting ones go on."""
        with self._lock:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def abort(self, message: str) -> None:
        """Fail every running and waiting request with `message` at the next step (shutdown deadline)."""
        with self._lock:
            self._draining, self._abort = True, message
            self._lock.notify_all()

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._lock:
            return len(self._rows), len(self._waiting)

    # -- the loop (engine thread) --------------------------------------------------------------
    def serve_forever(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._rows:
                    self._lock.wait()
                if self._stopping:
                    return
            self.step()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    def run_until_idle(self) -> None:
        while self._rows or self._waiting:
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        try:
            if self._abort is not None:
                self._fail_all(self._abort)
                return
            if not self._rows:
                self._last_decode = None        # the batch was empty: time since then is idle, not a token's
            self._drop_cancelled()
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
            if self._rows:
                self._decode()
        except Exception as exc:     # a failing pass fails its requests, never the engine
            self._fail_all(f"{type(exc).__name__}: {exc}")

    # -- internals -----------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        with self._lock:
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self._finish(request, "cancelled")
        gone = [i for i, r in enumerate(self._rows) if r.cancelled]
        for i in gone:
            self._finish(self._rows[i], "cancelled")
        if gone:
            self._retire()

    def _admit(self) -> list[Request]:
        with self._lock:
            admitted = []
            while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
                admitted.append(self._waiting.popleft())
            return admitted

    def _forward(self, ids, mask, positions, rows: list[Request], kind: str, cache=None):
        """One pass; returns (last-position logits [B, V], the cache, activations per row [B])."""
        if self.choose_plans is not None:
            self.choose_plans(rows, kind, len(self._rows) + (len(rows) if kind == "prefill" else 0))
        if self.handle is not None:
            self.handle.context.row_plans = [r.plan_index for r in rows]
        for request in rows:
            steps = request.plan_steps
            if steps is not None:
                if steps and steps[-1][0] == request.plan_index:
                    steps[-1][1] += 1
                else:
                    steps.append([request.plan_index, 1])
        started = self.clock()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kwarg: cache})
        ended = self.clock()
        seconds, interval = ended - started, None
        if kind == "decode":
            interval = ended - self._last_decode if self._last_decode is not None else None
            self._last_decode = ended
        cache = out["cache"] if "cache" in out else out.past_key_values
        if self.handle is not None:
            row_acts = self.handle.context.row_activations
            self.handle.context.row_plans = None
            per_row = row_acts.double().tolist() if row_acts is not None else [0.0] * len(rows)
        else:
            per_row = None
        if self.on_pass is not None:
            self.on_pass(StepStats(kind, len(rows), len({r.plan_index for r in rows}), seconds, interval))
        return out.logits[:, -1], cache, per_row

    def _prefill(self, admitted: list[Request]) -> None:
        lengths = [len(r.prompt_ids) for r in admitted]
        width = max(lengths)
        ids = torch.full((len(admitted), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(admitted), width, dtype=torch.long)                  # [B, P]
        for row, request in enumerate(admitted):
            ids[row, width - lengths[row]:] = torch.tensor(request.prompt_ids)
            mask[row, width - lengths[row]:] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)                             # [B, P]
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        logits, cache, per_row = self._forward(ids, mask, positions, admitted, "prefill")
        for row, request in enumerate(admitted):
            request.prefill_tokens = lengths[row]
            request.prefill_activations = per_row[row] if per_row else self._full(lengths[row])
        self._append_to_batch(cache, mask, admitted)
        self._sample(logits, admitted)
        self._retire()

    def _decode(self) -> None:
        rows = list(self._rows)
        ids = torch.tensor([[r.generated[-1]] for r in rows], device=self.device)     # [B, 1]
        positions = self._mask.sum(-1, keepdim=True)                               # [B, 1] real tokens so far
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)   # [B, L + 1]
        logits, self._cache, per_row = self._forward(ids, self._mask, positions, rows, "decode", self._cache)
        for row, request in enumerate(rows):
            request.decode_tokens += 1
            request.decode_activations += per_row[row] if per_row else self._full(1)
        self._sample(logits, rows)
        self._retire()

    def _full(self, tokens: int) -> float:
        from ..routing.layout import model_fingerprint

        if self.full_activations is None:
            fingerprint = model_fingerprint(self.model)
            self.full_activations = float(fingerprint["num_moe_layers"] * fingerprint["k_orig"])
        return self.full_activations * tokens

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> None:
        now = time.perf_counter()
        for row, request in enumerate(rows):
            if request.finished:
                continue
            token = next_token(logits[row], request.params, request.generator)
            logprob = float(torch.log_softmax(logits[row].float(), -1)[token]) if request.params.logprobs else None
            request.times.setdefault("first_token", now)
            reason = None
            if token in self.eos_ids and not request.params.ignore_eos:
                reason = "stop"
            else:
                request.generated.append(token)
                if logprob is not None:
                    request.logprobs.append(logprob)
                request.text.add(token)
                if request.text.stopped:
                    reason = "stop"
                elif len(request.generated) >= request.params.max_new_tokens:
                    reason = "length"
                elif len(request.prompt_ids) + len(request.generated) >= self.context_len:
                    reason = "length"
            if reason is not None:
                self._finish(request, reason)
            elif request.on_update is not None:
                request.on_update(request)

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request.finished:
            return
        request.finish_reason, request.error = reason, error
        request.times["finished"] = time.perf_counter()
        if request.on_update is not None:
            request.on_update(request)

    def _fail_all(self, message: str) -> None:
        for request in self._rows:
            self._finish(request, "error", message)
        with self._lock:
            while self._waiting:
                self._finish(self._waiting.popleft(), "error", message)
        self._rows, self._cache, self._mask = [], None, None

    def _append_to_batch(self, cache, mask: torch.Tensor, admitted: list[Request]) -> None:
        """Put the admitted rows' caches under the running batch's, right-aligned."""
        if not self._rows:
            self._rows, self._cache, self._mask = list(admitted), cache, mask
            return
        width = max(self._mask.size(1), mask.size(1))
        for old, new in zip(self._cache.layers, cache.layers):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)], dim=0)
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)], dim=0)
        self._mask = torch.cat([_left_pad(self._mask, width, dim=1), _left_pad(mask, width, dim=1)], dim=0)
        self._rows.extend(admitted)

    def _retire(self) -> None:
        """Drop finished rows from the batch and the padding columns no row needs any more."""
        keep = [i for i, r in enumerate(self._rows) if not r.finished]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._rows = [self._rows[i] for i in keep]
        self._mask = self._mask[index]
        lead = int((self._mask.sum(0) == 0).long().cumprod(0).sum())    # columns that are padding in every row
        self._mask = self._mask[:, lead:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, lead:]
            layer.values = layer.values[index, :, lead:]


def _left_pad(x: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """Zeros before `x` along `dim` up to `width` (a cache's sequence axis, or a mask's)."""
    missing = width - x.size(dim)
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [missing, 0]
    return F.pad(x, pad)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
