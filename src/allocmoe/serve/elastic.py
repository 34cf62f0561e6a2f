"""The elastic budget (`allocmoe serve --latency-target-ms T`): hold a decode step time under load by
spending fewer activations only when the batch is large.

The server keeps a *ladder* of plans, richest first (the full model, then 5/6, 2/3, 1/2, 1/3 of its
budget allocated from --profile, or the --plan files given, by budget). Before each decode pass
`Elastic.choose_plans` runs every elastic request (one that named no plan or budget) at the richest
rung whose predicted step time for the batch's size meets T, never below the request's floor
(`min_budget`). Requests that named a plan or a budget, or opted out, keep theirs.

The prediction and the choice are `core/elastic.py`'s (shared with the vLLM plugin): what this
server measured itself per (rung, batch size), never assumed of the machine; the first steps run full.

T is a time per output token: a decode step's measured time runs from the previous decode pass's
end to its own, so a prefill pass between them (requests joining the batch) counts against T. That
wait is learnt apart from the pass (it does not depend on the rung), so a burst of arrivals lifts
every rung's prediction for a few steps and then decays, rather than leaving one rung's cell high. Prefill passes run elastic requests at the rung
in force (the last decode decision), or, into an idle server, at the rung decided for the batch they
start (a lone request after a peak gets full, not the peak's last rung). `replay` reruns one request alone with a recorded
plan sequence (`--record-plans`), which is how the tests check that elastic output is honest.

Not here: the plans themselves (plans.py makes and holds them), the HTTP fields (app.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.elastic import Controller, Rung, StepTimes
from ..core.plan import Plan
from ..errors import AllocMoeError
from ..routing.apply import apply_plans
from .engine import Engine, Request, StepStats
from .plans import PlanRegistry, per_sequence
from .sampling import SamplingParams

DEFAULT_LADDER = ("5/6", "2/3", "1/2", "1/3")      # budgets below full, allocated from --profile


@dataclass(frozen=True)
class Step:
    """One decode pass the controller decided: what it predicted and what it measured (the time per
    output token of its rows: from the previous decode pass's end to its own, so a prefill pass
    between counts; the pass alone when the batch was idle before it)."""
    rows: int
    rung: int
    predicted: float | None
    measured: float


class Elastic(Controller):
    """Chooses each elastic request's rung before every pass (the engine's `choose_plans`), and learns
    from each decode pass's measured time (`observe`, on the engine's `on_pass`)."""

    def __init__(self, rungs: list[Rung], target_seconds: float, times: StepTimes | None = None,
                 on_step: Callable[[Rung, Step], None] = lambda rung, step: None, history: int = 4096):
        super().__init__(rungs, target_seconds, times)
        self.on_step = on_step              # told every decided decode step (metrics)
        self.steps: deque[Step] = deque(maxlen=history)     # the latest decode steps, for tests and tuning
        self.in_force = 0                   # the rung of the last decode decision; prefill uses it
        self._pending: tuple[int, int, float | None] | None = None

    def choose_plans(self, rows: list[Request], kind: str, batch: int) -> None:
        """Before a pass of `rows` (`kind` "prefill" or "decode"), `batch` the rows the batch has after it."""
        elastic = [r for r in rows if r.elastic is not None]
        if kind == "decode":
            rung, predicted = self.decide(len(rows))
            self.in_force = rung
            self._pending = (len(rows), rung, predicted) if elastic else self._fixed(rows)
        elif batch == len(rows):        # a prefill into an idle server: the rung for the batch it starts,
            self.in_force = self.decide(batch)[0]    # not the last decision of a load that has gone
        for request in elastic:
            request.plan_index = self.rungs[min(self.in_force, request.elastic)].index

    def _fixed(self, rows: list[Request]) -> tuple[int, int, float | None] | None:
        """A step with no elastic row still measures a rung when every row runs that rung's plan (requests
        that opted out run the full model; those that named a ladder plan run it)."""
        rung = self.fixed_rung({r.plan_index for r in rows})
        return None if rung is None else (len(rows), rung, self.times.predict(rung, len(rows)))

    def observe(self, stats: StepStats) -> None:
        if stats.kind != "decode" or self._pending is None:
            return
        rows, rung, predicted = self._pending
        self._pending = None
        seconds = self.learn(rung, rows, stats.seconds, stats.interval)
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

    def choose(rows: list[Request], kind: str, batch: int) -> None:
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
