"""Closed-form reduced-rank ridge regression: the one fit behind every linear stand-in.

Pure tensor math, no model. Given the centred second moments of inputs x [H_in] and targets y
[H_out] over n samples, the ridge least-squares map is B = (S_xx + lambda I)^-1 S_xy, lambda =
`ridge` x the mean input variance (keeps rare directions from blowing up). Cut to rank r it keeps
the r directions of the fitted output xB with the most variance (reduced-rank regression):
down = B V_r [H_in, r], up = V_r^T [r, H_out], V_r the top r eigenvectors of B^T S_xx B. That is
the best rank-r approximation, in the least-squares sense, of the fitted outputs xB, the same as a
truncated SVD of X B.

Used for each expert's stand-in (calibrate/means.py) and for the per-layer whole-error correction
measured in benchmarks/standin_directions.py.
"""

from __future__ import annotations

import torch


def reduced_rank_ridge(cov_xx: torch.Tensor, cov_xy: torch.Tensor, rank: int,
                       ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(down [H_in, r], up [r, H_out]) from the centred moments cov_xx [H_in, H_in] and cov_xy
    [H_in, H_out] (float64): the rank-`rank` reduced-rank ridge map, y - y_mean ~ ((x - x_mean) @ down) @ up."""
    hidden = cov_xx.size(0)
    strength = ridge * float(cov_xx.diagonal().mean().clamp_min(1e-12))
    b = torch.linalg.solve(cov_xx + strength * torch.eye(hidden, dtype=cov_xx.dtype), cov_xy)  # [H_in, H_out]
    _, vectors = torch.linalg.eigh(b.T @ cov_xx @ b)                                          # ascending
    top = vectors[:, vectors.size(1) - rank:].flip(-1)                                        # [H_out, r]
    return b @ top, top.T


class Moments:
    """Running sums for regressions of y on x, one per group (each expert of a layer; a single
    regression is one group): weights n [G], sums of x [G, H_in] and y [G, H_out], and, with `second`,
    of x x^T [G, H_in, H_in] and x y^T [G, H_in, H_out] (float64), each sample counted with its weight
    (1 unless given: a weighted least-squares fit); `samples` [G] counts the samples themselves, what
    decides whether a group has seen enough of them to fit. Without `second` only the means of y can be
    fitted (what the stand-ins need at rank 0)."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1, second: bool = True):
        self.n = torch.zeros(groups, dtype=torch.float64)
        self.samples = torch.zeros(groups, dtype=torch.float64)
        self.sx = torch.zeros(groups, in_features, dtype=torch.float64)
        self.sy = torch.zeros(groups, out_features, dtype=torch.float64)
        self.sxx = torch.zeros(groups, in_features, in_features, dtype=torch.float64) if second else None
        self.sxy = torch.zeros(groups, in_features, out_features, dtype=torch.float64) if second else None

    def add(self, x: torch.Tensor | None, y: torch.Tensor, groups: torch.Tensor | None = None,
            weights: torch.Tensor | None = None) -> None:
        """x [T, H_in] (None without second moments), y [T, H_out]: one sample per row; groups [T] each
        row's group (None: all in group 0); weights [T] each row's weight (None: 1 each; rows of weight
        0 add nothing, not even to `samples`)."""
        y = y.double()
        if groups is None:
            groups = torch.zeros(y.size(0), dtype=torch.long)
        if weights is not None:
            weights = weights.double()
            keep = weights > 0
            x, y, groups, weights = (None if x is None else x[keep]), y[keep], groups[keep], weights[keep]
        self.samples += torch.bincount(groups, minlength=self.n.numel()).double()
        self.n += (self.samples.new_zeros(self.n.numel()).index_add_(0, groups, weights) if weights is not None
                   else torch.bincount(groups, minlength=self.n.numel()).double())
        self.sy.index_add_(0, groups, y if weights is None else y * weights[:, None])
        if self.sxx is None:
            return
        x = x.double()
        xw = x if weights is None else x * weights[:, None]        # sum w x x^T = (w x)^T x
        self.sx.index_add_(0, groups, xw)
        parts = [(0, slice(None))] if self.n.numel() == 1 else ((g, groups == g) for g in groups.unique().tolist())
        for g, rows in parts:
            self.sxx[g] += xw[rows].T @ x[rows]
            self.sxy[g] += xw[rows].T @ y[rows]

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_mean [G, H_in], y_mean [G, H_out]); a group with no samples has means 0."""
        n = torch.where(self.n > 0, self.n, 1.0)[:, None]        # weights may sum to less than 1
        return self.sx / n, self.sy / n

    def fit(self, rank: int, ridge: float, group: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
        """(x_mean [H_in], y_mean [H_out], down [H_in, r], up [r, H_out]) of `group`:
        y ~ y_mean + ((x - x_mean) @ down) @ up."""
        x_means, y_means = self.means()
        x_mean, y_mean = x_means[group], y_means[group]
        if rank == 0:
            return x_mean, y_mean, torch.zeros(x_mean.numel(), 0, dtype=torch.float64), \
                torch.zeros(0, y_mean.numel(), dtype=torch.float64)
        n = float(self.n[group]) or 1.0
        cov_xx = self.sxx[group] / n - torch.outer(x_mean, x_mean)
        cov_xy = self.sxy[group] / n - torch.outer(x_mean, y_mean)
        down, up = reduced_rank_ridge(cov_xx, cov_xy, rank, ridge)
        return x_mean, y_mean, down, up
