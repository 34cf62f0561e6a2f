"""The elastic budget (`allocmoe serve --latency-target-ms T`): hold a decode step time under load by
spending fewer activations only when the batch is large.

The server keeps a *ladder* of plans, richest first (the full model, then 5/6, 2/3, 1/2, 1/3 of its
budget allocated from --profile, or the --plan files given, by budget). Before each decode pass
`Elastic.choose_plans` runs every elastic request (one that named no plan or budget) at the richest
rung whose predicted step time for the batch's size meets T, never below the request's floor
(`min_budget`). Requests that named a plan or a budget, or opted out, keep theirs.

The prediction is `StepTimes`: what this server measured itself, per (rung, batch size), an EWMA of
the decode pass's seconds plus an EWMA of its deviation (a bound above the mean, so that a typical
step, not only the average one, meets T), plus the same bound on what a token waits beyond its pass (below), kept over
every step whatever its rung. A cell not yet measured is estimated from the same rung's measured neighbours in
batch size (between two: linear; above only: the nearest above, since more rows cost no less; below
only: the nearest below grown as another rung measured at both sizes grows, else in proportion to the
rows, an upper bound when a step costs a fixed part plus a part per row). A rung never measured has
no prediction: it is tried only when stepping *down* (a poorer plan costs no more than a richer one
that is already predicted too slow), never up. Nothing is assumed of the machine: the first steps
run full, and the ladder is walked from what is measured.

T is a time per output token: a decode step's measured time runs from the previous decode pass's
end to its own, so a prefill pass between them (requests joining the batch) counts against T. That
wait is learnt apart from the pass (it does not depend on the rung), so a burst of arrivals lifts
every rung's prediction for a few steps and then decays, rather than leaving one rung's cell high. Prefill passes run elastic requests at the rung
in force (the last decode decision). `replay` reruns one request alone with a recorded
plan sequence (`--record-plans`), which is how the tests check that elastic output is honest.

Not here: the plans themselves (plans.py makes and holds them), the HTTP fields (app.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.plan import Plan
from ..errors import AllocMoeError
from ..routing.apply import apply_plans
from .engine import Engine, Request, StepStats
from .plans import PlanRegistry, per_sequence
from .sampling import SamplingParams

DEFAULT_LADDER = ("5/6", "2/3", "1/2", "1/3")      # budgets below full, allocated from --profile


@dataclass(frozen=True)
class Rung:
    index: int              # the plan's index in the server's PlanHandle
    name: str               # its name in usage and /metrics ("full" for the unmodified model)
    activations: float      # planned activations per token (Plan.budget)


@dataclass(frozen=True)
class Step:
    """One decode pass the controller decided: what it predicted and what it measured (the time per
    output token of its rows: from the previous decode pass's end to its own, so a prefill pass
    between counts; the pass alone when the batch was idle before it)."""
    rows: int
    rung: int
    predicted: float | None
    measured: float


class StepTimes:
    """Measured decode step seconds per (rung, batch size), and the prediction made from them."""

    def __init__(self, alpha: float = 0.25, spread: float = 1.0):
        self.alpha = alpha          # weight of the newest step in each cell's running means
        # deviations added to the mean: a bound above the mean, so a noisy step is not taken for a typical
        # one; 1, not 2, because T is near the one-client step (1.3x in the benchmark) and a bound
        # of two deviations on a shared CPU stepped one client down from full
        self.spread = spread
        self._cells: dict[int, dict[int, list[float]]] = {}     # rung -> rows -> [mean, |deviation|, at step]
        self._step = 0                  # steps observed, in any cell

    def observe(self, rung: int, rows: int, seconds: float) -> None:
        self._step += 1
        cell = self._cells.setdefault(rung, {}).get(rows)
        if cell is None:
            self._cells[rung][rows] = [seconds, 0.0, self._step]
            return
        deviation = abs(seconds - cell[0])
        cell[0] += self.alpha * (seconds - cell[0])
        cell[1] = self._deviation(cell) + self.alpha * (deviation - self._deviation(cell))
        cell[2] = self._step

    def _deviation(self, cell: list[float]) -> float:
        """A cell's deviation fades as other cells are measured: a rung left after one slow step is
        tried again once its measured mean meets T (the mean itself is never guessed down)."""
        return cell[1] * (1 - self.alpha) ** (self._step - cell[2])

    def measured(self, rung: int, rows: int) -> float | None:
        cell = self._cells.get(rung, {}).get(rows)
        return None if cell is None else cell[0] + self.spread * self._deviation(cell)

    def predict(self, rung: int, rows: int) -> float | None:
        own = {b: self.measured(rung, b) for b in self._cells.get(rung, {})}
        if rows in own:
            return own[rows]
        below = max((b for b in own if b < rows), default=None)
        above = min((b for b in own if b > rows), default=None)
        if below is not None and above is not None:
            w = (rows - below) / (above - below)
            return own[below] + w * (own[above] - own[below])
        if above is not None:
            return own[above]
        if below is None:
            return None
        growth = [self._between(other, below, rows) for other in self._cells if other != rung]
        growth = [g for g in growth if g is not None]
        return own[below] * (max(growth) if growth else rows / below)

    def _between(self, rung: int, below: int, rows: int) -> float | None:
        """How `rung`'s step time grows from `below` rows to `rows`, where it is measured at `below` and
        measured or bracketed at `rows` (never extrapolated)."""
        cells = self._cells[rung]
        if below not in cells or not any(b >= rows for b in cells):
            return None
        start = self.measured(rung, below)
        return self.predict(rung, rows) / start if start > 0 else None


class Elastic:
    """Chooses each elastic request's rung before every pass (the engine's `choose_plans`), and learns
    from each decode pass's measured time (`observe`, on the engine's `on_pass`)."""

    def __init__(self, rungs: list[Rung], target_seconds: float, times: StepTimes | None = None,
                 on_step: Callable[[Rung, Step], None] = lambda rung, step: None, history: int = 4096):
        if not target_seconds > 0 or target_seconds == float("inf"):
            raise AllocMoeError(f"the latency target must be a number of milliseconds above 0, got "
                                f"{target_seconds * 1000:g}; give e.g. 50")
        if not rungs:
            raise AllocMoeError("an elastic server needs a ladder of at least one plan")
        self.rungs, self.target = rungs, target_seconds
        self.times = times or StepTimes()
        self.on_step = on_step              # told every decided decode step (metrics)
        self.steps: deque[Step] = deque(maxlen=history)     # the latest decode steps, for tests and tuning
        self.in_force = 0                   # the rung of the last decode decision; prefill uses it
        # what a token waits beyond its decode pass (prefill passes of joining requests, sampling): one
        # running [mean, mean |deviation|] over every step, whatever its rung, so it stays current
        self.overhead = [0.0, 0.0]
        self._pending: tuple[int, int, float | None] | None = None

    def floor(self, min_activations: float | None) -> int:
        """The poorest rung a request with this floor accepts (the full model always qualifies)."""
        if min_activations is None:
            return len(self.rungs) - 1
        ok = [i for i, r in enumerate(self.rungs) if r.activations >= min_activations - 1e-9]
        return max(ok, default=0)

    def decide(self, rows: int) -> tuple[int, float | None]:
        """(rung, its predicted seconds) for a decode pass of `rows` rows."""
        extra = self.overhead[0] + self.times.spread * self.overhead[1]
        predicted = [self.times.predict(i, rows) for i in range(len(self.rungs))]
        predicted = [None if p is None else p + extra for p in predicted]
        for i, p in enumerate(predicted):
            if p is not None and p <= self.target:
                return i, p
        known = [i for i, p in enumerate(predicted) if p is not None]
        if not known:
            return 0, None                  # nothing measured yet: full quality
        # every prediction misses T: step down to the richest rung poorer than all of them
        rung = min(known[-1] + 1, len(self.rungs) - 1)
        return rung, predicted[rung]

    def choose_plans(self, rows: list[Request], kind: str) -> None:
        elastic = [r for r in rows if r.elastic is not None]
        if kind == "decode":
            rung, predicted = self.decide(len(rows))
            self.in_force = rung
            self._pending = (len(rows), rung, predicted) if elastic else self._fixed(rows)
        for request in elastic:
            request.plan_index = self.rungs[min(self.in_force, request.elastic)].index

    def _fixed(self, rows: list[Request]) -> tuple[int, int, float | None] | None:
        """A step with no elastic row still measures a rung when every row runs that rung's plan (requests
        that opted out run the full model; those that named a ladder plan run it)."""
        plans = {r.plan_index for r in rows}
        rung = next((i for i, r in enumerate(self.rungs) if {r.index} == plans), None)
        return None if rung is None else (len(rows), rung, self.times.predict(rung, len(rows)))

    def observe(self, stats: StepStats) -> None:
        if stats.kind != "decode" or self._pending is None:
            return
        rows, rung, predicted = self._pending
        self._pending = None
        self.times.observe(rung, rows, stats.seconds)
        seconds = stats.seconds
        if stats.interval is not None:
            seconds = stats.interval
            extra, alpha = max(0.0, stats.interval - stats.seconds), self.times.alpha
            self.overhead[1] += alpha * (abs(extra - self.overhead[0]) - self.overhead[1])
            self.overhead[0] += alpha * (extra - self.overhead[0])
        step = Step(rows, rung, predicted, seconds)
        self.steps.append(step)
        self.on_step(self.rungs[rung], step)


def make_ladder(registry: PlanRegistry, budgets: tuple[str, ...] = DEFAULT_LADDER) -> list[Rung]:
    """The rungs, richest first: full, then the registry's named plans by budget when it has any, else
    `budgets` allocated from its profile (held for the server's life, so they are never evicted)."""
    rungs = [Rung(0, "full", registry.full_budget)]
    named = [(i, n, p) for i, (n, p) in enumerate(zip(registry.names, registry.plans)) if n is not None]
    if named:
        for index, name, plan in sorted(named, key=lambda x: -float(x[2].budget)):
            rungs.append(Rung(index, name, float(plan.budget)))
        return rungs
    if registry.profile is None or registry.allocate is None:
        raise AllocMoeError("--latency-target-ms needs a ladder of plans: give --profile PROFILE.json (full, 5/6, "
                            "2/3, 1/2 and 1/3 of the budget are allocated from it) or the plans as --plan NAME=FILE")
    if registry.max_budget_plans <= len(budgets):
        raise AllocMoeError(f"the ladder's {len(budgets)} budget plans need max_budget_plans above "
                            f"{len(budgets)}, got {registry.max_budget_plans}")
    for budget in budgets:
        index, name = registry.resolve(None, None, budget)      # held, never released
        rungs.append(Rung(index, name, float(registry.plans[index].budget)))
    return rungs


def replay(model, tokenizer, prompt_ids: list[int], plans: dict[str, Plan], steps: list[list],
           params: SamplingParams) -> Request:
    """Run one request alone, pass by pass under the plans `steps` names ([name, passes] run-length, as
    usage.allocmoe.plans records it); returns the finished Request (its `generated` tokens)."""
    names = list(plans)
    order = [names.index(name) for name, count in steps for _ in range(int(count))]

    def choose(rows: list[Request], kind: str) -> None:
        request = rows[0]
        done = sum(n for _, n in request.plan_steps)
        if done >= len(order):
            raise AllocMoeError(f"the recorded sequence covers {len(order)} passes; this replay needs more")
        request.plan_index = order[done]

    handle = apply_plans(model, [per_sequence(plans[n]) for n in names])
    try:
        engine = Engine(model, tokenizer, handle, max_batch_size=1, max_queue=0, choose_plans=choose,
                        record_plans=True)
        request = engine.submit(Request(list(prompt_ids), params))
        with torch.no_grad():
            engine.run_until_idle()
    finally:
        handle.remove()
    if request.finish_reason == "error":
        raise AllocMoeError(f"the replay failed: {request.error}")
    return request
