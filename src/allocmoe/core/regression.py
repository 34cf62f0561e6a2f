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
    """Running sums for one regression of y on x: n, sums of x and y, of x x^T and x y^T (float64)."""

    def __init__(self, in_features: int, out_features: int):
        self.n = 0.0
        self.sx = torch.zeros(in_features, dtype=torch.float64)
        self.sy = torch.zeros(out_features, dtype=torch.float64)
        self.sxx = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.sxy = torch.zeros(in_features, out_features, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [T, H_in], y [T, H_out]: one sample per row."""
        x, y = x.double(), y.double()
        self.n += x.size(0)
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y

    def fit(self, rank: int, ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_mean [H_in], y_mean [H_out], down [H_in, r], up [r, H_out]): y ~ y_mean + ((x - x_mean) @ down) @ up."""
        n = max(self.n, 1.0)
        x_mean, y_mean = self.sx / n, self.sy / n
        if rank == 0:
            return x_mean, y_mean, torch.zeros(x_mean.numel(), 0, dtype=torch.float64), \
                torch.zeros(0, y_mean.numel(), dtype=torch.float64)
        cov_xx = self.sxx / n - torch.outer(x_mean, x_mean)
        cov_xy = self.sxy / n - torch.outer(x_mean, y_mean)
        down, up = reduced_rank_ridge(cov_xx, cov_xy, rank, ridge)
        return x_mean, y_mean, down, up
