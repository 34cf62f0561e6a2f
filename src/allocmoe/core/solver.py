"""Exact per-layer allocation: a multiple-choice knapsack solved by dynamic programming.

Given a cost table S[i][k-1] (layer i kept at k experts, k = 1..K) and an integer budget B, find
K_i in [1, K] with sum K_i <= B minimising sum S[i][K_i]:
    DP[i][b] = min over 1 <= k <= min(K, b) of DP[i-1][b-k] + S[i][k-1],   DP[-1][0] = 0
answer min over b <= B of DP[L-1][b], then backtrack. O(L * B * K); numpy over b.
Fractional budgets: the DP spends at most floor(B) (never more than asked). Ties between equal
totals go to the allocation that spends less, then to the lower layers' earlier choice.

Any finite table is solved, however large its values: each layer's row is taken relative to its
own minimum (which changes no comparison between allocations: every allocation pays each layer's
minimum once), so a profile of 1e308s sums zeros, and when even the relative rows could overflow a
sum of L of them, they are scaled down by a power of two (exact but for the smallest digits, which
no sum of such magnitudes can resolve anyway). Without this, inf - inf ties left the backtrack a k of 0.

`solve_menu_allocation` is the same choice over any menu per layer with fractional costs: auto's
(k, stand-in) pairs, whose stand-ins cost a fraction of an activation each (core/budget.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import AllocMoeError


def solve_allocation(costs: Sequence[Sequence[float]], budget: float) -> list[int]:
    """Per-layer k (1-based counts) minimising the summed cost with sum(k) <= floor(budget)."""
    table = np.asarray(costs, dtype=np.float64)                  # [L, K]
    if table.ndim != 2 or table.size == 0:
        raise AllocMoeError("the sensitivity table must be a non-empty L x K table")
    if not np.all(np.isfinite(table)):
        raise AllocMoeError("the sensitivity table holds NaN or infinite values; re-profile the model")
    if not isinstance(budget, (int, float, np.integer, np.floating)) or not math.isfinite(budget):
        raise AllocMoeError(f"budget {budget!r} must be a finite number of activations per token; give a count "
                            f"between {table.shape[0]} and {table.size}")
    table = relative_costs(table)
    num_layers, k_orig = table.shape
    total = min(int(math.floor(budget + 1e-9)), num_layers * k_orig)
    if total < num_layers:
        raise AllocMoeError(f"budget {budget:g} is below {num_layers}, one expert per MoE layer")
    best = np.full(total + 1, np.inf)                            # DP over activations spent so far
    best[0] = 0.0
    choice = np.zeros((num_layers, total + 1), dtype=np.int64)   # k chosen for layer i at spend b
    for i in range(num_layers):
        nxt = np.full(total + 1, np.inf)
        for k in range(1, min(k_orig, total) + 1):
            cand = np.full(total + 1, np.inf)
            cand[k:] = best[: total + 1 - k] + table[i, k - 1]
            better = cand < nxt
            nxt[better] = cand[better]
            choice[i, better] = k
        best = nxt
    spend = int(np.argmin(best))                                 # first minimum: the smaller spend
    ks = []
    for i in range(num_layers - 1, -1, -1):
        k = int(choice[i, spend])
        ks.append(k)
        spend -= k
    return ks[::-1]


def relative_costs(table: np.ndarray) -> np.ndarray:
    """`table` with each row less its minimum, scaled by a power of two if needed so that a sum of
    one value per row is finite (every value finite and >= 0; the best allocation unchanged)."""
    low = table.min(axis=1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        rel = table - low
        if not np.all(np.isfinite(rel)):        # a row spanning more than the largest double: halve first
            rel = np.ldexp(table, -2) - np.ldexp(low, -2)
    # the largest possible total, computed where it cannot overflow; scale so it stays below 2**1000
    bound = float(np.sum(np.ldexp(rel.max(axis=1), -64)))
    if bound > 0:
        shift = math.ceil(math.log2(bound)) + 64 - 1000
        if shift > 0:
            rel = np.ldexp(rel, -shift)
    return rel



def solve_menu_allocation(losses: Sequence[Sequence[float]], costs: Sequence[Sequence[float]],
                          budget: float) -> list[int]:
    """Per layer, the index of one option of its menu (e.g. the (k, stand-in rank) pairs) minimising the
    summed loss with the summed cost <= budget; costs may be fractional (a stand-in's activation-
    equivalents), so the DP runs over the Pareto frontier of (cost, loss) rather than a grid of whole
    budgets. Exact: a partial allocation dominated by another (no less cost and no less loss) can
    never complete to a better whole one, and only those are dropped. Ties go to the smaller cost.
    losses, costs: [L, J] (every layer offers J options). Feasible: cost <= budget + 1e-9."""
    table = np.asarray(losses, dtype=np.float64)                 # [L, J]
    price = np.asarray(costs, dtype=np.float64)                  # [L, J]
    if table.ndim != 2 or table.size == 0 or price.shape != table.shape:
        raise AllocMoeError("the menu's losses and costs must be two non-empty L x J tables of one shape")
    if not (np.all(np.isfinite(table)) and np.all(np.isfinite(price)) and np.all(price >= 0)):
        raise AllocMoeError("the menu holds NaN, infinite or negative values; re-profile the model")
    if not isinstance(budget, (int, float, np.integer, np.floating)) or not math.isfinite(budget):
        raise AllocMoeError(f"budget {budget!r} must be a finite number")
    table = relative_costs(table)
    limit = float(budget) + 1e-9
    if float(price.min(axis=1).sum()) > limit:
        raise AllocMoeError(f"budget {budget:g} is below {price.min(axis=1).sum():.4g}, the cheapest option of "
                            "every MoE layer")
    front_cost, front_loss = np.zeros(1), np.zeros(1)            # the frontier after the layers so far
    backs = []                                                   # per layer: (state it came from, option)
    for i in range(table.shape[0]):
        cost = (front_cost[:, None] + price[i][None, :]).ravel()  # [N * J]
        loss = (front_loss[:, None] + table[i][None, :]).ravel()
        fit = np.nonzero(cost <= limit)[0]
        order = fit[np.lexsort((loss[fit], cost[fit]))]          # by cost, then loss
        sorted_loss = loss[order]
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(sorted_loss)[:-1]))
        keep = order[sorted_loss < best_before]                  # strictly better than every cheaper state
        backs.append((keep // table.shape[1], keep % table.shape[1]))
        front_cost, front_loss = cost[keep], loss[keep]
    state = int(np.argmin(front_loss))                           # loss falls along the frontier: the last
    choice = []
    for parents, options in reversed(backs):
        choice.append(int(options[state]))
        state = int(parents[state])
    return choice[::-1]
