"""Cross-fitting: the stand-ins are never judged on the text they were fitted on.

`auto`, a refinement with stand-ins and a perplexity target's search with them choose by calibration
perplexity: which trial, with or without stand-ins, the (k, stand-in) menu's choice, each refinement
move, whether a budget meets the target. Stand-ins fitted on the windows that score them look better
there than on new text (issue #37: at 5/6 of the built-in model's budget, `auto` chose by in-sample
scores a plan that lost on test text to a simpler trial). So the calibration windows are split in two,
and each half takes both roles, one fold each (two-fold cross-fitting):

  even    windows 0, 2, 4, ...  (the first of each pair; the odd one out of an odd count)
  odd     windows 1, 3, 5, ...
  fold 1  stand-ins fitted on the even windows, scored on the odd ones;
  fold 2  stand-ins fitted on the odd windows, scored on the even ones.

A plan with stand-ins is scored by its perplexity over every calibration token, each token scored
with the stand-ins of the fold that did not see it (`held_out_perplexity`: the token-weighted mean
of the two folds' log-perplexities). A plan without them fits nothing and is scored on every window
at once, which is the same measure. Every choice is made by that score: auto's trials, each
refinement move, the remainder, a target's "meets it". Scoring with one fold alone (the previous
rule) judged on half the text; over the 20 quality cells (five families, four budgets) the two folds
chose a better plan on test text in 7, a worse one in 3, the same in 10 (docs/quality.md). The (k, stand-in)
menu's profile, which only proposes a trial that is then scored so, is measured on fold 1 alone.

The plan returned then has its stand-ins refitted on all the windows (`refit`), keeping every choice
made (k per layer, which layers carry stand-ins): twice the text for the fit, and the same cost, since
a stand-in is priced by its rank and the model's shapes (core/budget.py), not by its values.

Why alternate windows, not halves: the windows are consecutive chunks of the calibration text, so a
text that changes along its length (several sources one after another) gives both parts the same mix,
where halves would fit on one source and score on another. Neighbouring windows may share a document;
that is text of the same kind, not the same tokens, which is what the stand-ins over-fit.

Fewer than two windows cannot be split, and the run is refused (`split_windows`): falling back to
in-sample choice is the very choice this rule exists to prevent, and a warning scrolls away under the
progress bars. Runs without stand-ins fit nothing; all their windows choose.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import torch

from ..core.plan import Plan
from ..errors import AllocMoeError

SPLIT = ("two folds of alternate windows: stand-ins fitted on the even-numbered windows score the odd-numbered, "
         "and those fitted on the odd-numbered the even-numbered")


def split_windows(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(even, odd) windows [N_even, S], [N_odd, S] of calibration `windows` [N, S] (module docstring);
    refuses N < 2."""
    count, length = windows.shape
    if count < 2:
        raise AllocMoeError(f"the calibration text gives {count} window of {length} tokens; stand-ins are fitted on "
                            "one part of it and chosen on another, which needs at least 2 windows: give more "
                            f"--calib-tokens (calib_tokens; at least {2 * length}) or a longer --calib-text, or "
                            "turn the stand-ins off (--no-substitute)")
    return windows[0::2], windows[1::2]


def scored_tokens(windows: torch.Tensor) -> int:
    """Tokens a perplexity pass scores on `windows` [N, S]: each window's first token is context only."""
    return int(windows.numel() - windows.size(0))


def held_out_perplexity(plan: Plan, fold_means: tuple, windows: torch.Tensor,
                        perplexity: Callable[[Plan, torch.Tensor], float]) -> float:
    """`plan`'s perplexity on calibration `windows` [N, S], no token scored by stand-ins fitted on it
    (module docstring): `fold_means` = (stand-ins fitted on the even windows, on the odd ones), at a rank
    no lower than any of the plan's, of which each fold takes the plan's stand-in layers cut to the plan's
    ranks (core/means.py truncated); `perplexity(plan, windows)` scores one pass. A plan without
    stand-ins is scored on all `windows` at once."""
    if plan.means is None:
        return perplexity(plan, windows)
    ranks = plan.means.ranks
    even, odd = split_windows(windows)
    log_sum = 0.0
    for means, scored in zip(fold_means, (odd, even)):
        log_sum += scored_tokens(scored) * math.log(perplexity(replace(plan, means=means.truncated(ranks)), scored))
    return math.exp(log_sum / scored_tokens(windows))


def cross_fit_provenance(windows: torch.Tensor) -> dict[str, Any]:
    """What a plan records about its folds: windows on each side, and the tokens every choice was scored on."""
    even, odd = split_windows(windows)
    return {"split": SPLIT, "even_windows": int(even.size(0)), "odd_windows": int(odd.size(0)),
            "window_tokens": int(windows.size(1)), "scored_tokens": scored_tokens(windows)}


def refit(plan: Plan, means, windows: torch.Tensor, standin_costs, record: str = "cross_fit") -> Plan:
    """`plan` (stand-ins fitted on part of the windows, every choice cross-fitted) with its stand-ins
    replaced by `means`, fitted on all `windows` (at a rank no lower than the plan's), for the same layers
    and ranks; `standin_costs(means)` prices them.
    The cost is checked unchanged (a stand-in's price is its rank and the model's shapes). The windows
    are recorded under provenance[`record`]."""
    if plan.means is None:
        return plan
    means = means.truncated(plan.means.ranks)
    costs = standin_costs(means)
    if costs != plan.standins:
        raise AssertionError(f"refitted stand-ins cost {costs}, the chosen ones {plan.standins}")
    plan.means = means
    plan.provenance.setdefault(record, {}).update(final_means_windows=int(windows.size(0)),
                                                  final_means_tokens=int(windows.numel()))
    return plan
