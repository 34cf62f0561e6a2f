"""Exact per-layer allocation: a multiple-choice knapsack solved by dynamic programming.

Given a cost table S[i][k-1] (layer i kept at k experts, k = 1..K) and an integer budget B, find
K_i in [1, K] with sum K_i <= B minimising sum S[i][K_i]:
    DP[i][b] = min over 1 <= k <= min(K, b) of DP[i-1][b-k] + S[i][k-1],   DP[-1][0] = 0
answer min over b <= B of DP[L-1][b], then backtrack. O(L * B * K); numpy over b.
Fractional budgets: the DP spends at most floor(B) (never more than asked). Ties between equal
totals go to the allocation that spends less, then to the lower layers' earlier choice.
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


def allocation_cost(costs: Sequence[Sequence[float]], ks: Sequence[int]) -> float:
    return float(sum(costs[i][k - 1] for i, k in enumerate(ks)))
