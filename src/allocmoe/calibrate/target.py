"""A quality target instead of a budget: the smallest budget whose plan stays within a perplexity target.

`allocate(target_ppl="5%", method=..., model=..., ...)` (or `allocmoe allocate --target-ppl 5%`)
bisects over whole budgets, L..L*K_orig activations per token, with the chosen method: each step
makes that budget's plan and scores it on the calibration text. A step costs one calibration pass for
the profile-based and budget-only methods (the profile is reused); top-p and naee also rerun their
calibration pass, lexi its L x K deviation passes, and auto its trials, at every step. The
target is either relative to the full model's calibration perplexity ("5%": at most 1.05 x full) or
an absolute perplexity ("157.0").

Bisection assumes calibration perplexity does not rise when the budget grows. It need not hold
exactly (the DP's allocations at neighbouring budgets can differ in several layers), so the answer
is guaranteed to meet the target and to be the smallest budget meeting it among those tried, and
every budget tried is recorded with its perplexity in the plan's provenance (`target.tried`), where a
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
                      tried: dict[int, float], calib_tokens: int) -> dict[str, Any]:
    """What the plan records about how its budget was found."""
    return {"given": str(given), "perplexity": round(target, 6), "full_calibration_perplexity": round(full_ppl, 6),
            "budget_found": budget, "calibration_perplexity": round(tried[budget], 6),
            "calibration_tokens": calib_tokens,
            "tried": {str(b): round(p, 6) for b, p in sorted(tried.items())}}
