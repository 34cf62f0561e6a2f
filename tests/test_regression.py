"""core/regression.py: the reduced-rank ridge fit against brute force (lstsq on the augmented system + SVD)."""

import pytest
import torch

from allocmoe.core.regression import Moments, reduced_rank_ridge


def data(n=400, h_in=12, h_out=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h_in, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 3, h_in, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(h_in, h_out, generator=gen, dtype=torch.float64)) + 0.5   # not linear, offset
    return x, y


def brute_force(x, y, rank, ridge):
    """Centred ridge least squares as one lstsq on [X; sqrt(lambda n) I], then the best rank-r
    approximation (truncated SVD) of the fitted outputs."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    strength = ridge * float((xc ** 2).sum(0).mean())                  # the mean input variance, times n
    eye = torch.eye(x.size(1), dtype=torch.float64)
    b = torch.linalg.lstsq(torch.cat([xc, strength ** 0.5 * eye]),
                           torch.cat([yc, torch.zeros(x.size(1), y.size(1), dtype=torch.float64)])).solution
    u, s, vh = torch.linalg.svd(xc @ b, full_matrices=False)
    return b, u[:, :rank] * s[:rank] @ vh[:rank]


@pytest.mark.parametrize("rank", [1, 4, 10])
@pytest.mark.parametrize("ridge", [0.0, 1e-2, 1.0])
def test_the_fit_is_the_truncated_svd_of_the_ridge_solution(rank, ridge):
    x, y = data()
    moments = Moments(x.size(1), y.size(1))
    for part_x, part_y in zip(x.split(64), y.split(64)):             # summed in pieces, as the hooks do
        moments.add(part_x, part_y)
    x_mean, y_mean, down, up = moments.fit(rank, ridge)
    b, best = brute_force(x, y, rank, ridge)
    torch.testing.assert_close(x_mean, x.mean(0))
    torch.testing.assert_close(y_mean, y.mean(0))
    assert down.shape == (x.size(1), rank) and up.shape == (rank, y.size(1))
    torch.testing.assert_close((x - x_mean) @ down @ up, best, rtol=1e-7, atol=1e-9)
    if rank == y.size(1):                                              # full rank: the ridge map itself
        torch.testing.assert_close(down @ up, b, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_the_error_left_on_the_fit_data_never_grows_with_the_rank(seed):
    """Rank 0 is the mean alone (never worse than nothing); each rank removes at least as much."""
    x, y = data(seed=seed)
    moments = Moments(x.size(1), y.size(1))
    moments.add(x, y)
    errors = [float((y ** 2).sum())]                                   # no correction at all
    for rank in range(0, y.size(1) + 1):
        x_mean, y_mean, down, up = moments.fit(rank, 1e-2)
        errors.append(float(((y - y_mean - (x - x_mean) @ down @ up) ** 2).sum()))
    assert all(later <= earlier + 1e-9 for earlier, later in zip(errors, errors[1:]))
    assert errors[-1] < errors[1] < errors[0]


def test_the_map_alone_matches_the_moments_fit():
    x, y = data(seed=3)
    xc, yc = x - x.mean(0), y - y.mean(0)
    n = x.size(0)
    down, up = reduced_rank_ridge(xc.T @ xc / n, xc.T @ yc / n, 3, 1e-2)
    moments = Moments(x.size(1), y.size(1))
    moments.add(x, y)
    _, _, down2, up2 = moments.fit(3, 1e-2)
    torch.testing.assert_close(down @ up, down2 @ up2)


def test_grouped_sums_fit_each_group_as_its_own_regression():
    """One Moments over three groups (rows interleaved, added in pieces) fits each group as a Moments of
    that group's rows alone; an empty group has means 0; without second moments only the means."""
    x, y = data(seed=4)
    groups = torch.arange(x.size(0)) % 3
    groups[groups == 2] = 0                                           # group 2 stays empty
    grouped, means_only = Moments(x.size(1), y.size(1), groups=3), Moments(x.size(1), y.size(1), 3, second=False)
    for part in torch.arange(x.size(0)).split(50):
        grouped.add(x[part], y[part], groups[part])
        means_only.add(None, y[part], groups[part])
    for g in (0, 1):
        alone = Moments(x.size(1), y.size(1))
        alone.add(x[groups == g], y[groups == g])
        (gx, gy, gd, gu), (ax, ay, ad, au) = grouped.fit(3, 1e-2, group=g), alone.fit(3, 1e-2)
        torch.testing.assert_close(gx, ax)
        torch.testing.assert_close(gy, ay)
        torch.testing.assert_close(gd @ gu, ad @ au)                  # each direction's sign is free
        torch.testing.assert_close(means_only.means()[1][g], y[groups == g].mean(0))
    assert grouped.n.tolist() == [float((groups == 0).sum()), float((groups == 1).sum()), 0.0]
    assert not grouped.means()[1][2].any() and means_only.sxx is None


def test_a_weighted_fit_is_the_fit_of_each_row_repeated_as_often_as_its_weight():
    """Integer weights (0 drops a row) against the same rows repeated: the same means and map; `samples`
    counts the rows given with a positive weight, `n` their weights."""
    x, y = data(seed=5)
    weights = torch.arange(x.size(0)) % 4                                # 0, 1, 2, 3, ...
    groups = torch.arange(x.size(0)) % 2
    weighted, repeated = Moments(x.size(1), y.size(1), groups=2), Moments(x.size(1), y.size(1), groups=2)
    weighted.add(x, y, groups, weights.double() / 2)                      # scale does not matter, only ratios
    repeated.add(x.repeat_interleave(weights, 0), y.repeat_interleave(weights, 0), groups.repeat_interleave(weights))
    for g in (0, 1):
        (wx, wy, wd, wu), (rx, ry, rd, ru) = weighted.fit(3, 1e-2, group=g), repeated.fit(3, 1e-2, group=g)
        torch.testing.assert_close(wx, rx)
        torch.testing.assert_close(wy, ry)
        torch.testing.assert_close(wd @ wu, rd @ ru)
    assert weighted.samples.tolist() == [float(((weights > 0) & (groups == g)).sum()) for g in (0, 1)]
    assert weighted.n.tolist() == pytest.approx([float(weights[groups == g].sum()) / 2 for g in (0, 1)])
