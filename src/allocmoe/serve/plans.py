"""The plans a server routes by: the full model, the plans it was started with, and plans
allocated on the fly for a requested budget (from a profile, by the exact solver, then cached).

Model ids follow `MODEL@NAME`. Alloc-T layers pool per sequence here: a batch-wide pool would let
one request's tokens take another request's activations.

At most `max_budget_plans` budget plans are kept: a new budget past that evicts the least recently
used one that no request holds (`resolve` holds a plan until `release`), reusing its slot in the
handle, so one client asking for many budgets cannot lock later clients out.

The registry makes a budget's plan with the `allocate` function it is handed (allocmoe.allocate,
wired by the command line): the server stands beside calibration, not above it, and imports none of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

from ..routing.apply import PlanHandle, apply_plans, static_plan
from ..core.budget import Budget
from ..errors import AllocMoeError
from ..core.plan import PLAN_NAME, Plan
from ..routing.layout import check_plan, model_fingerprint
from ..core.policies import AllocT
from .protocol import PROFILE_METHODS

# makes the plan for a requested budget: allocmoe.allocate, or any function called as it is called here,
# allocate(budget, method, profile=PROFILE or None, model=MODEL, config={"progress": False}) -> Plan
Allocate = Callable[..., Plan]


class UnknownPlan(AllocMoeError):
    """A request named a model or plan this server does not serve (HTTP 404)."""


def per_sequence(plan: Plan) -> Plan:
    layers = {i: replace(p, pool="sequence") if isinstance(p, AllocT) else p for i, p in plan.layers.items()}
    return replace(plan, layers=layers)


class PlanRegistry:
    def __init__(self, model, model_name: str, plans: dict[str, Plan] | None = None,
                 profile: dict[str, Any] | None = None, max_budget_plans: int = 32,
                 on_evict: Callable[[str], None] = lambda name: None, allocate: Allocate | None = None):
        self.model, self.model_name, self.profile = model, model_name, profile
        self.allocate = allocate            # None: a request for a budget is refused (plans are named instead)
        self.on_evict = on_evict            # told the name of each budget plan evicted (metrics forget it)
        self.max_budget_plans = max_budget_plans
        self._budget_lru: OrderedDict[str, int] = OrderedDict()   # budget plan name -> index, oldest use first
        self._holders: dict[int, int] = {}                        # index -> requests holding it
        fingerprint = model_fingerprint(model)
        self.num_layers, self.k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
        self.full_budget = float(self.num_layers * self.k_orig)
        full = static_plan(model, [self.k_orig] * self.num_layers, method="full")
        self.names: list[str | None] = [None]        # index in the handle -> plan name (None: full model)
        self.plans: list[Plan] = [full]
        self._by_name: dict[str, int] = {}
        self._lock = threading.Lock()
        self._allocating = threading.Lock()
        for name, plan in (plans or {}).items():
            if not PLAN_NAME.match(name):
                raise AllocMoeError(f"plan name {name!r} must be letters, digits, '.', '_' or '-' (at most 64)")
            if name in self._by_name:
                raise AllocMoeError(f"two plans are named {name!r}; give each --plan NAME=FILE its own name")
            check_plan(plan, model)
            self._by_name[name] = len(self.plans)
            self.names.append(name)
            self.plans.append(per_sequence(plan))
        self.handle: PlanHandle = apply_plans(model, self.plans)

    def model_ids(self) -> list[tuple[str, str | None, Plan]]:
        with self._lock:
            return [(self.model_name if n is None else f"{self.model_name}@{n}", n, p)
                    for n, p in zip(self.names, self.plans)]

    def resolve(self, model_field: str | None, plan: str | None, budget: float | str | None,
                method: str = "alloc-moe") -> tuple[int, str | None]:
        """(index in the handle, plan name) for a request's `model` and `allocmoe` fields."""
        named = None
        if model_field is not None and model_field != self.model_name:
            base, sep, named = model_field.partition("@")
            if not sep or base != self.model_name:
                raise UnknownPlan(f"the model {model_field!r} does not exist; this server serves "
                                  f"{self.model_name!r} (see GET /v1/models)")
        if named is not None and plan is not None and named != plan:
            raise AllocMoeError(f"the request names two plans: {named!r} in 'model' and {plan!r} in "
                                "'allocmoe.core.plan'; name one")
        name = named if named is not None else plan
        if name is not None and budget is not None:
            raise AllocMoeError("the request names both a plan and a budget; give one of them")
        if budget is not None:
            return self._for_budget(budget, method)
        if name is None:
            with self._lock:
                return self._held(0, None)
        with self._lock:
            if name not in self._by_name:
                known = ", ".join(sorted(self._by_name)) or "none"
                raise UnknownPlan(f"no plan named {name!r} on this server (plans: {known}); see GET /v1/models")
            if name in self._budget_lru:
                self._budget_lru.move_to_end(name)
            return self._held(self._by_name[name], name)

    def release(self, index: int) -> None:
        """A request that `resolve` gave `index` has finished with it."""
        with self._lock:
            left = self._holders.get(index, 0) - 1
            if left > 0:
                self._holders[index] = left
            else:
                self._holders.pop(index, None)

    def _held(self, index: int, name: str | None) -> tuple[int, str | None]:
        self._holders[index] = self._holders.get(index, 0) + 1     # under self._lock
        return index, name

    def _for_budget(self, budget: float | str, method: str) -> tuple[int, str]:
        if isinstance(budget, bool):
            raise AllocMoeError("allocmoe.core.budget must be a number or a string such as '1/2'")
        parsed = Budget.parse(str(budget), self.num_layers, self.k_orig)
        if self.allocate is None:
            raise AllocMoeError("this server makes no plans for a budget (it was given no allocate function, "
                                "ServerConfig.allocate); name a plan instead")
        if method in PROFILE_METHODS and self.profile is None:
            raise AllocMoeError(f"a budget with method {method!r} needs a profile: start the server with "
                                "--profile PROFILE.json, or name a plan instead")
        name = f"{method}-B{parsed.activations_per_token:g}"
        with self._lock:
            if name in self._budget_lru:
                self._budget_lru.move_to_end(name)
                return self._held(self._budget_lru[name], name)
        with self._allocating:    # one allocation at a time; requests for other plans do not wait on it
            with self._lock:      # again: the same budget may have been made while this one waited
                if name in self._budget_lru:
                    self._budget_lru.move_to_end(name)
                    return self._held(self._budget_lru[name], name)
                self._victim()                                  # all slots held: refuse before the work
            plan = per_sequence(self.allocate(parsed, method, profile=self.profile, model=self.model,
                                              config={"progress": False}))    # no bars in a server's log
            with self._lock:
                victim = self._victim()
                if victim is None:
                    index = self.handle.add_plan(plan)
                    self.names.append(name)
                    self.plans.append(self.handle.plans[index])
                else:
                    index = self._budget_lru.pop(victim)
                    del self._by_name[victim]
                    self.on_evict(victim)
                    self.handle.replace_plan(index, plan)
                    self.names[index], self.plans[index] = name, plan
                self._by_name[name] = index
                self._budget_lru[name] = index
                return self._held(index, name)

    def _victim(self) -> str | None:
        """The budget plan a new one replaces (None: there is room); under self._lock."""
        if len(self._budget_lru) < self.max_budget_plans:
            return None
        victim = next((n for n, i in self._budget_lru.items() if not self._holders.get(i)), None)
        if victim is None:
            raise AllocMoeError(f"all {self.max_budget_plans} plans made for budgets are in use by running "
                                "requests; retry shortly, ask for one of those budgets (see GET /v1/models), "
                                "or name a plan")
        return victim

    def close(self) -> None:
        self.handle.remove()
