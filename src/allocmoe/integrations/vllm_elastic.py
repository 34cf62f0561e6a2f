"""The elastic budget in vLLM (`ALLOCMOE_LATENCY_TARGET_MS=T`, issue 38 item 2): per step, requests that
name no plan run the richest plan of a ladder whose predicted step time for the step's size meets T.

    ALLOCMOE_PLANS=b3=p3.json,b2=p2.json ALLOCMOE_LATENCY_TARGET_MS=50 vllm serve MODEL
    ALLOCMOE_LADDER=b3,b2       # optional: the ladder's plans (default: every ALLOCMOE_PLANS plan)
    ALLOCMOE_RECORD_PLANS=1     # optional: note each request's plan per step (`read_elastic`)

The ladder's top is the plan of requests that name none (ALLOCMOE_PLAN, else the full model), then
the ladder's plans by budget, each below the top's. The controller is allocmoe's own
(`core/elastic.py`, as `allocmoe serve --latency-target-ms`), keyed as there by the step's size in
requests. T is a time per output token: a decode step (one token per request) is measured in the
worker from the previous decode step's end to its own when it continues one of its requests (so a
step between them that carried prompt tokens, and scheduling and output handling, count as the wait
its tokens saw, learnt apart from the pass), else from the model runner's `execute_model` to the end
of its `sample_tokens` (the pass). A step carrying prompt tokens is decided by its requests too, and
is not learnt as a cell (its time depends on its prompt tokens, which the cell does not know).
Per request
(`SamplingParams.extra_args` / `vllm_xargs`): `allocmoe_plan` keeps that plan, `allocmoe_elastic:
false` keeps the top rung, `allocmoe_min_budget` (a fraction or a count, as `--budget`) is a floor.

`clock` is the clock the worker measures with; a test may replace it (a clock only the model moves).
"""

from __future__ import annotations

import math
import time
from collections import deque

from ..core.elastic import Controller, Rung, check_target
from ..errors import AllocMoeError

ENV_TARGET, ENV_LADDER, ENV_RECORD = "ALLOCMOE_LATENCY_TARGET_MS", "ALLOCMOE_LADDER", "ALLOCMOE_RECORD_PLANS"
XARG_FLOOR, XARG_ELASTIC = "allocmoe_min_budget", "allocmoe_elastic"

clock = time.perf_counter          # read at every call, so a test may set vllm_elastic.clock


def parse_target(text: str) -> float:
    """ALLOCMOE_LATENCY_TARGET_MS -> seconds, or a one-line refusal."""
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    try:
        check_target(ms / 1000)
    except AllocMoeError:
        raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_TARGET}={text!r} must be a number of milliseconds "
                            "above 0; give e.g. 50, or unset it") from None
    return ms / 1000


def parse_ladder(text: str) -> list[str] | None:
    names = [n.strip() for n in text.split(",") if n.strip()]
    return names or None


def make_rungs(names: list[str], plans: list, ladder: list[str] | None) -> list[Rung]:
    """The rungs, richest first: index 0 (the plan of requests naming none, `plans[0]`, None for the full
    model), then the ladder's plans (default: every named plan below the top) by budget."""
    full = next((p.full_budget for p in plans if p is not None), None)
    top = Rung(0, names[0], float(plans[0].budget if plans[0] is not None else full))
    chosen = ladder if ladder is not None else names[1:]
    unknown = [n for n in chosen if n not in names[1:]]
    if unknown:
        raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_LADDER} names {', '.join(map(repr, unknown))}, not in "
                            f"ALLOCMOE_PLANS ({', '.join(names[1:]) or 'none'}); give names from ALLOCMOE_PLANS")
    if len(set(chosen)) != len(chosen):
        raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_LADDER} names a plan twice; give each once")
    rungs = [Rung(names.index(n), n, float(plans[names.index(n)].budget)) for n in chosen]
    above = [r.name for r in rungs if r.activations >= top.activations - 1e-9]
    if ladder is None:              # every named plan that spends less than the top (a full or distinct one does not)
        rungs = [r for r in rungs if r.name not in above]
    elif above:
        raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_LADDER} names {', '.join(above)}, which spend as much as "
                            f"the top of the ladder or more ({top.name}: {top.activations:g} activations per "
                            f"token); give plans below it")
    if not rungs:
        raise AllocMoeError(f"allocmoe vLLM plugin: {ENV_TARGET} needs a ladder of plans below the top ({top.name}: "
                            f"{top.activations:g} activations per token); give ALLOCMOE_PLANS with smaller budgets")
    return [top] + sorted(rungs, key=lambda r: -r.activations)


def opted_in(extra_args) -> bool:
    """`allocmoe_elastic` (default true). vLLM's HTTP `vllm_xargs` takes only strings and numbers, so a
    JSON false arrives as 0: 0/1 and "false"/"true" are read as the booleans."""
    value = (extra_args or {}).get(XARG_ELASTIC, True)
    read = {"true": True, "false": False}.get(value.lower()) if isinstance(value, str) else \
        value if isinstance(value, bool) else bool(value) if value in (0, 1) else None
    if read is None:
        raise AllocMoeError(f"{XARG_ELASTIC} must be true or false (or 1 or 0), got {value!r}")
    return read


def request_floor(extra_args, plans: list, named: bool) -> float | None:
    """A request's floor in activations per token (None: none), refusing what cannot apply (`named`: the
    request names a plan)."""
    from ..core.budget import Budget

    floor, elastic = (extra_args or {}).get(XARG_FLOOR), opted_in(extra_args)
    if floor is None:
        return None
    if named:
        raise AllocMoeError(f"{XARG_FLOOR} applies to requests the server may step down under load; this one "
                            "names a plan, which it keeps: drop one of them")
    if not elastic:
        raise AllocMoeError(f"{XARG_FLOOR} applies only to elastic requests; drop it or {XARG_ELASTIC}: false")
    if isinstance(floor, bool) or not isinstance(floor, (int, float, str)):
        raise AllocMoeError(f"{XARG_FLOOR} must be a number or a string such as '1/2', got {floor!r}")
    plan = next(p for p in plans if p is not None)
    return Budget.parse(str(floor), plan.full_budget // plan.k_orig, plan.k_orig).activations_per_token


class VllmElastic(Controller):
    """The controller in one vLLM worker: `choose` in the runner's `_prepare_inputs` (the step's requests
    are known there), `begin`/`end` around the step; the step log and, with recording, each request's
    plans per step, for `read_elastic`. Each rung's first decode step is measured but not learnt from: on
    vLLM CPU a plan's first step paid one-time set-up (a fresh engine's first step took 2.8 s where the
    next took 9 ms; the first under a ladder plan 43 ms, then 9), and the controller never steps up on a
    guess to undo a cell measured that high."""

    def __init__(self, rungs: list[Rung], target_seconds: float, names: list[str], plans: list,
                 record: bool = False, history: int = 4096):
        super().__init__(rungs, target_seconds)
        self.names, self.plans, self.record = names, plans, record
        # [tokens, requests, rung, predicted, per output token, pass, learnt from] of each step at one rung
        self.steps: deque[list] = deque(maxlen=history)
        self.recorded: dict[str, list[list]] = {}             # request id -> [[plan name, steps], ...]
        self._pending: tuple[int, int, int, float | None] | None = None
        self._start: float | None = None
        self._last: tuple[float, set[str]] | None = None      # the previous decode step's end, its requests
        self._ids: list[str] = []                               # the requests of the step in progress
        self._seen: set[int] = set()                            # rungs that ran a step (the first is not learnt)
        self._limits_of: dict[str, tuple] = {}                  # the last step's requests: _limits

    def begin(self) -> None:
        self._start = clock()

    def _limits(self, requests: list[tuple[str, int, object, int | None]]) -> list[tuple[bool, int | None]]:
        """Per request of the step, (elastic, the poorest rung it may run: None when it keeps its named plan,
        0 when it opted out). Read from its extra_args once per request, not at every step: they do not
        change while it runs, and parsing a floor costs about 20 us, a request of every step's batch. The
        cache holds the step's requests only, each with the extra_args object it was read from."""
        known, limits = self._limits_of, {}
        for rid, _, args, named in requests:
            hit = known.get(rid)
            if hit is None or hit[0] is not args or hit[1] != named:
                elastic = named is None and opted_in(args)
                reach = None if named is not None else \
                    self.floor(request_floor(args, self.plans, False)) if elastic else 0
                hit = (args, named, elastic, reach)
            limits[rid] = hit
        self._limits_of = limits
        return [limits[rid][2:] for rid, _, _, _ in requests]

    def choose(self, requests: list[tuple[str, int, object, int | None]], agree=lambda rung: rung) -> list[int]:
        """Plan indices for a step of (request id, its tokens, its extra_args, its named plan or None);
        `agree` makes every tensor-parallel rank take rank 0's rung."""
        tokens, rows = sum(n for _, n, _, _ in requests), len(requests)
        rung, predicted = self.decide(rows)
        rung = agree(rung)
        limits = self._limits(requests)
        chosen = [named if reach is None else self.rungs[min(rung, reach)].index
                  for (_, _, _, named), (_, reach) in zip(requests, limits)]
        elastic = any(flexible for flexible, _ in limits)
        at = rung if elastic else self.fixed_rung(set(chosen))
        predicted = predicted if elastic or at is None else self.times.predict(at, rows)
        self._pending = (tokens, rows, at, predicted)
        self._ids = [rid for rid, _, _, _ in requests]
        if self.record:
            for (rid, _, _, _), index in zip(requests, chosen):
                runs = self.recorded.setdefault(rid, [])
                name = self.names[index]
                if runs and runs[-1][0] == name:
                    runs[-1][1] += 1
                else:
                    runs.append([name, 1])
        return chosen

    def end(self) -> None:
        """The step's sampling finished: measure it and teach the controller. A decode step (one token per
        request) measures its rung at its size, from the previous decode step's end when it continues one
        of its requests (so a step between them that carried prompt tokens counts as the wait, learnt
        apart from the pass, as `allocmoe serve` counts a prefill pass), else its pass alone."""
        now, ids, pending, start = clock(), set(self._ids), self._pending, self._start
        self._pending = self._start = None
        if pending is None or start is None:
            return
        tokens, rows, rung, predicted = pending
        decode, last = tokens == rows, self._last
        if decode:
            self._last = (now, ids)
        interval = now - last[0] if decode and last is not None and last[1] & ids else None
        learnt = decode and rung is not None and rung in self._seen
        if decode and rung is not None:
            self._seen.add(rung)    # a plan's first step pays one-time set-up: 43 ms, then 9, on vLLM CPU
        measured = self.learn(rung, rows, now - start, interval) if learnt else (interval or now - start)
        if rung is not None:
            self.steps.append([tokens, rows, rung, predicted, measured, now - start, learnt])

    def report(self) -> dict:
        return {"target": self.target, "rungs": [[r.name, r.activations] for r in self.rungs],
                "steps": [list(s) for s in self.steps], "plans": {k: [list(r) for r in v]
                                                                  for k, v in self.recorded.items()}}
