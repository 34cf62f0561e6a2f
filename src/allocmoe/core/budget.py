"""Activation budgets: parse what a user types and convert between fractions and counts.

One *activation* is one (token, routed expert) pair in one MoE layer; shared experts and dense
layers do not count. A budget B is activations per token summed over the MoE layers, so the full
budget is L * K_orig and the smallest meaningful one is L (every layer keeps one expert).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from ..errors import AllocMoeError


_DECIMAL = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?"
# the documented forms, in ASCII only: 0.5, .5, 78, 78.0, 1e-1 (str() of a float), 50%, 12.5%, 1/2. No
# "_", no spaces, no other digits, an exponent of at most 3 digits: Python's float() and Fraction()
# would take "1_0", "50 %" and "١" (an Arabic-Indic one), and Fraction("1e999999999") builds
# 10**999999999 holding the GIL for hours. The server's request schema publishes this pattern.
BUDGET_PATTERN = rf"^(?:{_DECIMAL}%?|[0-9]+/[0-9]+)$"
# a leading "-" too, only so that "-0.5" is told it must be positive
_BUDGET_FORM = re.compile(rf"-?(?:{_DECIMAL}%?|[0-9]+/[0-9]+)")


def strict_float(raw: str, percent: bool = False) -> float:
    """`raw` as a float if it is a plain ASCII decimal (0.5, .5, 157, 1e-1; with `percent`, also 5%
    as 0.05; nan and inf, which the caller refuses as out of range), else ValueError: float() would
    take "1_0", " 5 " and non-ASCII digits. Other flags that take a number, such as --target-ppl,
    read it with this."""
    form = rf"-?(?:{_DECIMAL}|nan|inf|infinity){'%?' if percent else ''}"
    if not isinstance(raw, str) or len(raw) > 64 or not re.fullmatch(form, raw, re.IGNORECASE | re.ASCII):
        raise ValueError(f"not a number: {raw!r}")
    return float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)


def read_fraction_or_count(raw: str) -> tuple[float, bool]:
    """(the number typed, whether it is a fraction): a value with "/" or "%", or a number <= 1, is a
    fraction ("50%" -> 0.5); a number > 1 is a count. The one reading rule of every budget flag
    (activations here, distinct experts in calibrate/distinct.py and bench). ValueError if not one of
    the documented forms (_BUDGET_FORM), or too large for a float."""
    if not isinstance(raw, str) or len(raw) > 64 or not _BUDGET_FORM.fullmatch(raw):
        raise ValueError(f"not a number: {raw!r}")
    try:
        value = float(Fraction(raw[:-1]) / 100 if raw.endswith("%") else Fraction(raw))
    except (ValueError, ZeroDivisionError, OverflowError):            # 1/0; 1e400, past any float
        raise ValueError(f"not a number: {raw!r}") from None
    return value, "/" in raw or raw.endswith("%") or value <= 1


def round_half_up(x: float) -> int:
    """floor(x + 0.5): the rounding every count made from a fraction uses (as Alloc-T's does)."""
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class Budget:
    activations_per_token: float   # B: the count the allocation must not exceed
    full: int                      # L * K_orig: the unmodified model's count
    num_layers: int                # L: MoE layers sharing the budget

    @property
    def fraction(self) -> float:
        return self.activations_per_token / self.full

    @property
    def per_layer(self) -> float:
        return self.activations_per_token / self.num_layers

    @classmethod
    def parse(cls, text: str | float, num_layers: int, k_orig: int) -> "Budget":
        """Parse "0.5", "1/2", "50%" (fractions of full) or "78" (a count).

        Rule: a value with "/" or "%", or a number <= 1, is a fraction of the full budget;
        a number > 1 is a count of activations per token. ASCII digits only, no spaces or "_".
        """
        full = num_layers * k_orig
        raw = str(text)
        try:
            value, is_fraction = read_fraction_or_count(raw)
        except ValueError:
            raise AllocMoeError(
                f"budget {raw!r} is not a number in a form allocmoe reads; give a fraction of the full budget "
                f"(0.5, 1/2, 50%) or a count of activations per token (e.g. {full // 2} of {full})") from None
        count = value * full if is_fraction else value
        if not count > 0 or count != count:
            raise AllocMoeError(f"budget {raw!r} must be positive; give a fraction in (0, 1] or a count "
                                f"between {num_layers} and {full}")
        count = round(count, 9)  # 1/3 * 36 -> 12.0, not 11.999999999999998
        if count > full:
            raise AllocMoeError(f"budget {raw!r} = {count:g} activations per token is above the full budget "
                                f"{full} ({num_layers} MoE layers x K={k_orig}); give at most 1.0 or {full}")
        if count < num_layers:
            raise AllocMoeError(f"budget {raw!r} = {count:g} activations per token is below {num_layers}, the "
                                f"minimum (every one of the {num_layers} MoE layers keeps at least one expert); "
                                f"give at least {num_layers / full:.3g} or {num_layers}")
        return cls(count, full, num_layers)


# -- what a plan's work costs, in activations ------------------------------------------------------
# A plan's cost per token is its activations plus its stand-ins (routing/substitute.py) converted to
# activation-equivalents: a stand-in's multiply-adds over one expert's. `--budget` bounds that total.
# Counted per (token, slot), weights only (norms, activation functions and biases are not counted):
#   an expert:   its weight matrices (3 x H x I for a gated expert: gate, up, down) + H for gate x output
#   a stand-in:  2 x H x r for ((x @ down) @ up)  + H for gate x (offset + that)
# so a rank-0 stand-in (the means alone) is H / (3 H I + H) and rank r adds 2 H r to it.
def expert_multiply_adds(hidden: int, intermediate: int, matrices: int = 3) -> int:
    """One routed expert's weight multiply-adds per token: `matrices` x H x I (3 for a gated, SwiGLU
    expert; 2 for a plain up-down MLP)."""
    return matrices * hidden * intermediate


def standin_multiply_adds(hidden: int, rank: int) -> int:
    """One stand-in's multiply-adds per skipped slot: 2 x H x r for its rank-r term, H for its weighted sum."""
    return hidden * (2 * rank + 1)


def standin_equivalent(hidden: int, expert_weights: int, rank: int) -> float:
    """A skipped slot's stand-in in activation-equivalents: its multiply-adds over one expert's (an
    expert's `expert_weights` weight multiply-adds plus H for its weighted sum)."""
    if hidden < 1 or expert_weights < 1 or rank < 0:
        raise AllocMoeError(f"a stand-in's cost needs hidden >= 1, expert weights >= 1 and rank >= 0, got "
                            f"{hidden}, {expert_weights}, {rank}")
    return standin_multiply_adds(hidden, rank) / (expert_weights + hidden)


def layer_cost(k: float, k_orig: int, standin: float | None) -> float:
    """A layer's cost per token: its k activations plus, with a stand-in of `standin` activation-
    equivalents per skipped slot (None: no stand-in), one stand-in for each of the K_orig - k skipped."""
    return k if standin is None else k + (k_orig - k) * standin


def plan_costs(k_per_layer: dict[int, float | None], k_orig: int,
               standins: dict[int, float]) -> dict[int, float | None]:
    """Each layer's cost (`layer_cost`), None where a layer's k is not set (top-p, naee: measured only).
    `standins` holds the per-slot stand-in cost of each layer that has one."""
    return {index: None if k is None else layer_cost(k, k_orig, standins.get(index))
            for index, k in k_per_layer.items()}


def expert_budget(budget: Budget, standin: float, k_orig: int, what: str = "the substitute") -> Budget:
    """The activations a plan with a stand-in of `standin` activation-equivalents on every layer may
    spend so that its total stays within B: a + (L x K_orig - a) x u <= B, so a <= (B - L K u) / (1 - u)
    (whatever the layers' split: the total depends on the activations' sum alone). Rounded down at
    the 9th decimal, so the total never passes B. One line if even one expert per layer will not fit."""
    slots = budget.num_layers * k_orig
    most = (budget.activations_per_token - slots * standin) / (1.0 - standin)
    most = min(math.floor(most * 1e9 + 1e-6) / 1e9, float(budget.full))
    least = budget.num_layers * (1 + (k_orig - 1) * standin)
    if most < budget.num_layers:
        raise AllocMoeError(f"budget {budget.activations_per_token:g} cannot hold {what}: one expert per MoE layer "
                            f"plus stand-ins for the other {k_orig - 1} costs {least:.4g} activations per token; "
                            f"give at least {least:.4g} ({least / budget.full:.3g}), or leave the substitute out")
    return Budget(most, budget.full, budget.num_layers)
