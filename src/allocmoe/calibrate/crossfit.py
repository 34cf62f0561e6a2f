"""Cross-fitting: the stand-ins are never judged on the text they were fitted on.

`auto`, a refinement with stand-ins and a perplexity target's search with them choose by calibration
perplexity: which trial, with or without stand-ins, the (k, stand-in) menu's choice, each refinement
move, whether a budget meets the target. Stand-ins fitted on the windows that score them look better
there than on new text (issue #37: at 5/6 of the built-in model's budget, `auto` chose by in-sample
scores a plan that lost on test text to a simpler trial). So the calibration windows are split in two:

  fit     windows 0, 2, 4, ...  (the first of each pair; the odd one out of an odd count)
          the stand-ins (means and rank-r terms, calibrate/means.py) are fitted here, and only here;
  choose  windows 1, 3, 5, ...
          every choice is scored here: auto's trials, the (k, stand-in) profile, each refinement
          move, a target's "meets it".

The plan returned then has its stand-ins refitted on all the windows (`refit`), keeping every choice
made (k per layer, which layers carry stand-ins): twice the text for the fit, and the same cost, since
a stand-in is priced by its rank and the model's shapes (core/budget.py), not by its values.

Why alternate windows, not halves: the windows are consecutive chunks of the calibration text, so a
text that changes along its length (several sources one after another) gives both parts the same mix,
where halves would fit on one source and choose on another. Neighbouring windows may share a document;
that is text of the same kind, not the same tokens, which is what the stand-ins over-fit.

Fewer than two windows cannot be split, and the run is refused (`split_windows`): falling back to
in-sample choice is the very choice this rule exists to prevent, and a warning scrolls away under the
progress bars. Runs without stand-ins fit nothing; all their windows choose.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.plan import Plan
from ..errors import AllocMoeError

SPLIT = "alternate windows: even-numbered fit the stand-ins, odd-numbered choose"


def split_windows(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, choose) windows [N_fit, S], [N_choose, S] of calibration `windows` [N, S] (module docstring);
    refuses N < 2."""
    count, length = windows.shape
    if count < 2:
        raise AllocMoeError(f"the calibration text gives {count} window of {length} tokens; stand-ins are fitted on "
                            "one part of it and chosen on another, which needs at least 2 windows: give more "
                            f"--calib-tokens (calib_tokens; at least {2 * length}) or a longer --calib-text, or "
                            "turn the stand-ins off (--no-substitute)")
    return windows[0::2], windows[1::2]


def cross_fit_provenance(windows: torch.Tensor) -> dict[str, Any]:
    """What a plan records about its split: windows and scored tokens on each side (a window of S
    tokens scores S - 1)."""
    fit, choose = split_windows(windows)
    return {"split": SPLIT, "fit_windows": int(fit.size(0)), "choose_windows": int(choose.size(0)),
            "fit_tokens": int(fit.numel()), "choose_scored_tokens": int(choose.numel() - choose.size(0))}


def refit(plan: Plan, means, windows: torch.Tensor, standin_costs, record: str = "cross_fit") -> Plan:
    """`plan` (stand-ins fitted on the fit windows, choices made on the choose windows) with its stand-ins
    replaced by `means`, fitted on all `windows`, for the same layers; `standin_costs(means)` prices them.
    The cost is checked unchanged (a stand-in's price is its rank and the model's shapes). The windows
    are recorded under provenance[`record`]."""
    if plan.means is None:
        return plan
    means = means.restricted(sorted(plan.means.means))
    costs = standin_costs(means)
    if costs != plan.standins:
        raise AssertionError(f"refitted stand-ins cost {costs}, the chosen ones {plan.standins}")
    plan.means = means
    plan.provenance.setdefault(record, {}).update(final_means_windows=int(windows.size(0)),
                                                  final_means_tokens=int(windows.numel()))
    return plan
