"""The (k, stand-in rank) profile: where a layer's stand-ins are worth what they cost, and at what rank.

Alloc-L's isolating profile (profile.py), each cell measured without stand-ins and with the stand-ins
of each rank of a menu on its layer: MoE layer i at k, layers before it at K_orig, deeper layers at
top-1, and a stand-in (if any) on layer i alone. `auto` hands the tables to the exact DP over each
layer's menu of (k, rank) pairs (core/solver.py solve_menu_allocation), whose costs are k plus the
stand-ins' activation-equivalents at that rank (core/budget.py), so it buys a layer's stand-ins only
where they lower the loss more than the activations they displace would, and at the rank that pays
(by default the menu holds one rank, substitute_rank; with rank_menu, 0, r/2, r and 2r).

The tables come from the same calibration windows, through the same cells code (cells.py, prefix-cached
as the profile is: each cell starts from the held states of its first reduced layer). Cells that
coincide run once: (i, K_orig) with a stand-in is (i, K_orig) without it (nothing is skipped) and
(i, K_orig) is (i + 1, 1): L*K - (L-1) plain cells and L*(K-1) per rank with a stand-in. `auto` measures it on
the odd windows of its calibration split with the means fitted on the even ones (one fold of calibrate/
crossfit.py), so the menu's proposal rests on text the stand-ins were not fitted on; auto then scores
that proposal on both folds like every other trial. The tables are kept on the
model, keyed by the windows, the means themselves (a digest) and the batching, so a sweep's budgets
measure them once.
Not resumable and not on Ray or layer by layer (the profile is): a (k, stand-in) profile is one
calibration pass per cell of the model as loaded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..core.means import ExpertMeans
from ..routing.apply import static_plan
from ..routing.layout import model_fingerprint
from ..scoring.perplexity import evaluate_perplexity, windows_digest
from .cells import CellBar, CellRun
from .prefix import profile_start_layer, start_position
from .profile import profile_cells

MEMO_ATTR = "_allocmoe_pair_profiles"     # on the model: {key: tables}, the tables a sweep's budgets share


def pair_profile(model, windows: torch.Tensor, menu: dict[int, ExpertMeans], windows_per_pass: int,
                 progress: bool = False) -> dict[str, Any]:
    """{"plain": S[i][k-1], "standin": {r: S_r[i][k-1]}} on `windows`, for MoE layer i (in MoE-layer order),
    k in 1..K_orig and each rank r of `menu` (r -> the stand-ins at that rank): calibration perplexity of
    cell (i, k) without, and with layer i's stand-ins of rank r on layer i alone; "cells" and
    "layer_passes" say what it ran. Memoised on the model (module docstring)."""
    key = (windows_digest(windows), tuple((r, _digest(m)) for r, m in sorted(menu.items())), windows_per_pass)
    memo = model.__dict__.setdefault(MEMO_ATTR, {})
    if key not in memo:
        memo[key] = _measure(model, windows, menu, windows_per_pass, progress)
    return memo[key]


def _digest(means: ExpertMeans) -> str:
    """A digest of the means' values (safetensors' bytes are not stable: their header's order varies)."""
    digest = hashlib.sha256(f"{means.tokens},{means.rank}".encode())
    for index, mean in sorted(means.means.items()):
        term = (means.linear or {}).get(index)
        for tensor in (mean, *((term.input_mean, term.down, term.up) if term is not None else ())):
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _measure(model, windows, menu: dict[int, ExpertMeans], windows_per_pass: int, progress: bool) -> dict[str, Any]:
    fingerprint = model_fingerprint(model)
    num_layers, k_orig, moe_layers = fingerprint["num_moe_layers"], fingerprint["k_orig"], fingerprint["moe_layers"]
    plain = profile_cells(num_layers, k_orig)                       # configuration -> the (i, k) it fills
    cells = [(cfg, None) for cfg in plain]
    cells += [(tuple([k_orig] * i + [k] + [1] * (num_layers - i - 1)), (i, r))
              for r, means in sorted(menu.items()) for i in range(num_layers) for k in range(1, k_orig)
              if moe_layers[i] in means.means]
    start = profile_start_layer(moe_layers, k_orig)
    ppl_config = {"windows_per_pass": windows_per_pass, "progress": False}

    def plan_for(cell):
        cfg, standin = cell
        plan = static_plan(model, list(cfg), method="profile")
        if standin is not None:
            i, r = standin
            plan.means = menu[r].restricted([moe_layers[i]])
        return plan

    run = CellRun(model, windows, windows_per_pass, cells, start_layer=lambda cell: start(cell[0]),
                  plan_for=plan_for,
                  score=lambda: evaluate_perplexity(model, None, "", ppl_config, windows=windows).perplexity,
                  label=lambda cell: f"MoE layer {start_position(cell[0], k_orig) + 1}/{num_layers}"
                                     + (f" + rank-{cell[1][1]} stand-in" if cell[1] is not None else ""))
    bar = CellBar(total=len(cells), desc="k x stand-in rank", unit="cell", disable=not progress,
                  work_total=run.planned_passes())
    found = {}
    try:
        for cell, ppl in run.cells(bar):
            found[cell] = ppl
            bar.update(1)
    finally:
        bar.close()
        run.release()
    table = {"plain": [[0.0] * k_orig for _ in range(num_layers)]}
    for cfg, filled in plain.items():
        for i, k in filled:
            table["plain"][i][k - 1] = found[(cfg, None)]
    # a layer without means (none here: auto measures every layer's) would keep its plain row
    table["standin"] = {r: [[found.get((tuple([k_orig] * i + [k] + [1] * (num_layers - i - 1)), (i, r)),
                                       table["plain"][i][k - 1]) for k in range(1, k_orig + 1)]
                            for i in range(num_layers)] for r in sorted(menu)}
    return {**table, "cells": len(cells), "layer_passes": run.passes}

