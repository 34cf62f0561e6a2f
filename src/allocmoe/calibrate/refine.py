"""Joint refinement of an allocation: move activations between layers while calibration text improves.

The profile scores each layer alone (the others at K_orig or top-1), so the DP's allocation ignores
how layers interact once all are cut. Refinement starts from a plan and, each round, tries every
move of one activation from layer a to layer b (a keeps at least 1, b at most K_orig), measured as
calibration perplexity of the whole plan; it takes the best move if it improves, and stops when
none does or the evaluation bound is spent. The budget never changes (each move keeps the sum), and
the result is never worse on calibration text than the start: only improving moves are taken. Where
stand-ins sit on some layers only, a move can change the plan's cost (core/budget.py): the caller's
`fits` keeps every move within B.

Each evaluation is one calibration pass over a new allocation (a move back to one already scored is
free). Scores are memoised by allocation, so a caller that persists `memo` (the CLI keeps it in a
partial file beside the plan) resumes without rescoring, along the same path.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any, Callable, MutableMapping

from tqdm import tqdm

from ..core.files import atomic_write_json, read_json
from ..core.plan import Plan
from ..core.policies import AllocT, StaticTopK
from ..errors import AllocMoeError


def with_k(plan: Plan, ks: dict[int, float], k_base: int) -> Plan:
    """`plan` with layer k's replaced, each layer keeping its policy type (Alloc-T's k_base capped at k)."""
    out = copy.copy(plan)
    out.layers = {}
    for index, policy in plan.layers.items():
        k = ks[index]
        if isinstance(policy, StaticTopK):
            out.layers[index] = StaticTopK(int(k))
        else:
            out.layers[index] = AllocT(k=k, k_base=min(k_base, int(math.floor(k + 1e-9))), pool=policy.pool)
    return out


def refine_allocation(plan: Plan, calib_ppl: Callable[[Plan], float], max_evaluations: int, k_base: int = 1,
                      memo: MutableMapping[str, float] | None = None, progress: bool = False,
                      fits: Callable[[dict[int, float]], bool] | None = None) -> tuple[Plan, dict]:
    """Refine `plan` (static top-k or Alloc-T layers) with at most `max_evaluations` calibration passes;
    with `fits`, only moves to allocations it accepts (a plan whose stand-ins sit on some layers only:
    a move from such a layer to one without adds a stand-in's cost). Returns the refined plan and what
    the search did (for the plan's provenance)."""
    if not all(isinstance(p, (StaticTopK, AllocT)) for p in plan.layers.values()):
        raise AllocMoeError(f"refinement moves activations between top-k or alloc-t layers; the {plan.method!r} "
                            "plan has other policies: refine an alloc-moe, alloc-l, alloc-t or uniform plan")
    k_orig = plan.k_orig
    memo = {} if memo is None else memo
    ks = {index: float(policy.k) for index, policy in sorted(plan.layers.items())}
    seen: set[str] = set()          # allocations this run has scored: the bound counts these

    def score(trial: dict[int, float]) -> float | None:
        """Calibration perplexity of `trial`; None once the bound is spent and it was not scored yet.
        A saved score counts as scored, so a resumed run takes the path an uninterrupted one takes."""
        key = ",".join(f"{i}:{k:g}" for i, k in sorted(trial.items()))
        if key not in seen:
            if len(seen) >= max_evaluations:
                return None
            seen.add(key)
            bar.update(1)
            if key not in memo:
                memo[key] = calib_ppl(with_k(plan, trial, k_base))
        return memo[key]

    bar = tqdm(total=max_evaluations, desc="refine", unit="eval", disable=not progress)
    try:
        start = best = score(ks)
        moves = []
        while len(seen) < max_evaluations:
            found = None
            for a in ks:
                for b in ks:
                    if a == b or ks[a] - 1 < 1 - 1e-9 or ks[b] + 1 > k_orig + 1e-9:
                        continue
                    trial = {**ks, a: ks[a] - 1, b: ks[b] + 1}
                    if fits is not None and not fits(trial):
                        continue
                    got = score(trial)
                    if got is not None and got < best and (found is None or got < found[0]):
                        found = (got, trial, [a, b])
            if found is None:             # a local optimum: the bar ends here, full, not at n/bound
                bar.total = len(seen)
                bar.set_postfix_str(f"ppl {best:.4g}, no move helps")
                break
            best, ks = found[0], found[1]
            moves.append(found[2])
            bar.set_postfix_str(f"ppl {best:.4g}")
    finally:
        bar.close()
    refined = with_k(plan, ks, k_base)
    return refined, {"evaluations": len(seen), "max_evaluations": max_evaluations, "moves": moves,
                     "start_calibration_perplexity": round(start, 6), "calibration_perplexity": round(best, 6)}


MIN_REMAINDER = 0.05     # activation-equivalents: a remainder below this is left unspent (too little to move a score)


def fill_remainder(plan: Plan, calib_ppl: Callable[[Plan], float], budget: float, pool: str = "batch",
                   progress: bool = False, start: float | None = None) -> tuple[Plan, dict]:
    """Spend what whole k leave of `budget` (B minus the plan's total cost: stand-ins priced per slot
    cannot be bought in whole experts, so a plan of whole k may leave up to a tenth of B). For each
    layer l below K_orig, the plan with l's k raised by r / (1 - u_l) (r the remainder, u_l its
    stand-in's cost per skipped slot, 0 without; capped at K_orig) run as Alloc-T that still gives
    every token its whole k (k_base = floor of the old k): the extra goes to the tokens whose next
    candidate carries most probability. Each is scored by `calib_ppl`; the best is taken if it beats
    the plan. One pass per layer below K_orig, plus the plan's own unless the caller gives it (`start`,
    its `calib_ppl` score). Returns the plan and a record."""
    standins = plan.standin_costs() or {}
    cost = plan.cost()["total"]
    remainder = budget - cost
    record: dict[str, Any] = {"remainder": round(remainder, 6)}
    if remainder < MIN_REMAINDER or not all(isinstance(p, (StaticTopK, AllocT)) for p in plan.layers.values()):
        return plan, record
    trials = {}
    for index, policy in sorted(plan.layers.items()):
        k = float(policy.k)
        if k < plan.k_orig:
            raised = min(float(plan.k_orig), k + math.floor(remainder / (1 - standins.get(index, 0.0)) * 1e9) / 1e9)
            base = policy.k_base if isinstance(policy, AllocT) else int(k)
            filled = copy.copy(plan)
            filled.layers = {**plan.layers, index: AllocT(k=raised, k_base=base,
                                                          pool=policy.pool if isinstance(policy, AllocT) else pool)}
            if filled.cost()["total"] <= budget + 1e-9:
                trials[index] = filled
    if not trials:
        return plan, record
    scores = {}
    for index, filled in tqdm(trials.items(), desc="spend the remainder", unit="eval", disable=not progress):
        scores[index] = calib_ppl(filled)
    start = calib_ppl(plan) if start is None else start
    best = min(scores, key=scores.get)
    record.update(start_calibration_perplexity=round(start, 6),
                  tried={str(i): round(v, 6) for i, v in scores.items()})
    if scores[best] < start:
        record.update(layer=best, k=trials[best].layers[best].k, calibration_perplexity=round(scores[best], 6))
        return trials[best], record
    return plan, record


class SavedScores(dict):
    """A refinement memo that writes itself atomically to `path` on every new score, under `key` (what
    the scores depend on: model, calibration, method, budget, substitute). A rerun with the same key
    resumes from it; with another key, or a damaged file, it starts afresh. `finish()` removes it."""

    def __init__(self, path: str | Path, key: dict[str, Any]):
        super().__init__()
        self.path, self.key = Path(path), key
        if self.path.is_file():
            try:
                saved = read_json(self.path, "partial refinement")
                if saved.get("key") == key:
                    self.update({str(k): float(v) for k, v in saved["scores"].items()})
            except (AllocMoeError, AttributeError, KeyError, TypeError, ValueError):
                print(f"allocmoe: warning: {self.path} is damaged; refining from the start", file=sys.stderr)

    def __setitem__(self, allocation: str, ppl: float) -> None:
        super().__setitem__(allocation, ppl)
        atomic_write_json(self.path, {"key": self.key, "scores": dict(self)})

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)
