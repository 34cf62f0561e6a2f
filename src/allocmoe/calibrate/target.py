"""A quality target instead of a budget: the smallest budget whose plan stays within a perplexity target.

`allocate(target_ppl="5%", method=..., model=..., ...)` (or `allocmoe allocate --target-ppl 5%`)
bisects over whole budgets with the chosen method: each step makes that budget's plan and scores it.
A budget is a plan's total cost per token, activations plus its stand-ins' activation-equivalents
(core/budget.py), so the range is total cost: L (one expert per layer, no stand-ins) or, for a
method with stand-ins on every layer, the smallest whole budget holding one expert per layer and its
stand-ins, up to L*K_orig. The plan returned costs at most the budget found; its provenance
(`target`) records that budget (`budget_found`), the plan's own total cost (`total_cost`) and every
budget tried with its perplexity (`tried`).

Which windows judge "meets the target": the full model's perplexity (for a relative target) and every
step's plan are scored on all the calibration windows. For a run whose plans carry stand-ins (`auto`
with its default substitute, or `--substitute`), each step's plan is cross-fitted (calibrate/
crossfit.py): the odd-numbered windows are scored with its stand-ins fitted on the even-numbered, and
the other way round, so a budget is never judged on text its stand-ins were fitted on (auto's own
choices within a step are scored the same way). The plan returned then has its stand-ins refitted on
all the calibration windows, keeping its layers and cost. A run without stand-ins fits nothing and is
scored on every window at once. The scored tokens are `calibration_tokens`, and `judged_on` names how.

A step costs one calibration pass for the profile-based and budget-only methods (the profile is
reused), plus a fit pass for the stand-ins; top-p and naee also rerun their calibration pass, lexi
its L x K deviation passes, and auto its trials, at every step. The target is either relative to the
full model's perplexity on the calibration windows ("5%": at most 1.05 x full) or an absolute perplexity
("157.0"). The full budget is scored as the unmodified model: its plan skips nothing, so even with
stand-ins it spends all of it on experts (core/budget.py expert_budget gives L*K_orig back).

Bisection assumes the judged perplexity does not rise when the budget grows. It need not hold
exactly (the DP's allocations at neighbouring budgets can differ in several layers), so the answer
is guaranteed to meet the target and to be the smallest budget meeting it among those tried, where a
user can check it. No test text is ever looked at.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..core.budget import strict_float
from ..errors import AllocMoeError


def parse_target(text: str | float, full_ppl: float) -> float:
    """"5%" -> full_ppl x 1.05; "157" or 157.0 -> 157.0. Refuses what no model could meet or mean."""
    raw = str(text).strip()
    try:
        value = strict_float(raw, percent=True)         # ASCII only: no "5_0%", "٥%", "5 %"
    except (ValueError, OverflowError):
        raise AllocMoeError(f"perplexity target {raw!r} is not a number; give a percentage above the full "
                            "model's calibration perplexity (5%) or a perplexity (157.0)") from None
    if not math.isfinite(value) or value < 0 or (not raw.endswith("%") and value < 1):
        raise AllocMoeError(f"perplexity target {raw!r} is out of range; give a percentage >= 0 (5%) or a "
                            "perplexity >= 1 (157.0)")
    return full_ppl * (1 + value) if raw.endswith("%") else value


REACH = 100          # a target above REACH x the vocabulary size is refused (check_target_reach)


def check_target_reach(text: str | float, vocab_size: int | None) -> None:
    """Refuse, before any pass, a target above REACH x V, a hundred times the perplexity of guessing
    uniformly among the model's V tokens (a relative target too: the full model's perplexity is at least
    1, so 1 + the percentage is a floor of the target). An untrained model sits near V; no plan worth
    making is a hundred times worse, so the search would only spend calibration passes on such a target."""
    raw = str(text).strip()
    parse_target(raw, 1.0)                        # its form first: the same refusals as ever
    if not vocab_size:
        return
    value = float(raw[:-1]) / 100 + 1 if raw.endswith("%") else float(raw)
    if value > REACH * vocab_size:
        raise AllocMoeError(f"perplexity target {raw!r} is above {REACH * vocab_size}, {REACH} times the perplexity of "
                            f"guessing uniformly among this model's {vocab_size} tokens; give a lower target, or "
                            "--budget for a plan of a chosen size")


def smallest_budget(num_layers: int, k_orig: int, target: float, full_ppl: float,
                    ppl_at: Callable[[int], float], progress: Callable[[int, float], None] | None = None,
                    least: int | None = None) -> tuple[int, dict[int, float]]:
    """(the smallest whole budget B in [max(L, least), L*K] with ppl_at(B) <= target, {budget: perplexity}
    tried). `least`: the smallest budget a plan can be made at (with stand-ins, one expert per layer
    and its stand-ins cost more than L).

    `ppl_at(B)` scores B's plan on calibration text. The full budget is the unmodified model, whose
    perplexity `full_ppl` the caller measured; a target below it cannot be met and is refused.
    """
    full = num_layers * k_orig
    if full_ppl > target:
        raise AllocMoeError(f"no budget meets the perplexity target {target:.4g}: the full model's calibration "
                            f"perplexity is {full_ppl:.4g}; give a target at or above it")
    tried: dict[int, float] = {full: full_ppl}

    def meets(budget: int) -> bool:
        if budget not in tried:
            tried[budget] = ppl_at(budget)
            if progress:
                progress(budget, tried[budget])
        return tried[budget] <= target

    low, high = max(num_layers, least or 0), full          # invariant: high meets the target; budgets below low were ruled out
    if meets(low):
        return low, tried
    while high - low > 1:                 # low fails, high meets
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high, tried


def target_provenance(given: str | float, target: float, full_ppl: float, budget: int,
                      tried: dict[int, float], calib_tokens: int, cost: dict[str, Any] | None = None,
                      judged_on: str = "all calibration windows") -> dict[str, Any]:
    """What the plan records about how its budget was found: `budget` is a total cost bound, `cost`
    the found plan's own (Plan.cost), `judged_on` the windows that judged (module docstring)."""
    found = {"given": str(given), "perplexity": round(target, 6), "full_calibration_perplexity": round(full_ppl, 6),
             "budget_found": budget, "calibration_perplexity": round(tried[budget], 6),
             "calibration_tokens": calib_tokens, "judged_on": judged_on,
             "tried": {str(b): round(p, 6) for b, p in sorted(tried.items())}}
    if cost is not None:
        found.update(total_cost=round(cost["total"], 9), activations=round(cost["activations"], 9))
    return found
