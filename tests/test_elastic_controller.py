"""The elastic controller alone (core/elastic.py), on numbers: the rung it chooses by step size under a
cost model the test states, with a clock only that model moves (no wall clock)."""

from __future__ import annotations

import pytest

from allocmoe.core.elastic import Controller, Rung, StepTimes
from allocmoe.errors import AllocMoeError

FIXED, PER_TOKEN = 0.010, 0.002          # seconds: a step costs FIXED + PER_TOKEN x size x (budget / full)
TARGET = 0.031
LADDER = [Rung(0, "full", 4.0), Rung(1, "b3", 3.0), Rung(2, "b2", 2.0)]


def cost(rung: int, size: int) -> float:
    return FIXED + PER_TOKEN * size * LADDER[rung].activations / 4.0


def richest_meeting_target(size: int) -> int:
    """The independent answer: the richest rung whose true cost meets T (the poorest when none does)."""
    return next((i for i in range(len(LADDER)) if cost(i, size) <= TARGET + 1e-12), len(LADDER) - 1)


def run(controller: Controller, sizes: list[int]) -> list[int]:
    chosen = []
    for size in sizes:
        rung, _ = controller.decide(size)
        controller.learn(rung, size, cost(rung, size), interval=None)
        chosen.append(rung)
    return chosen


def test_at_low_load_every_step_runs_full():
    controller = Controller(LADDER, TARGET)
    assert run(controller, [5, 1, 1, 1, 1, 1, 1, 1]) == [0] * 8          # 5 prompt tokens, then decode


def test_the_rung_follows_the_step_size_once_measured():
    controller = Controller(LADDER, TARGET)
    # a load that grows and shrinks twice: 1 to 16 tokens per step and back
    sizes = list(range(1, 17)) + list(range(16, 0, -1))
    first = run(controller, sizes)
    assert first[0] == 0 and max(first) == 2
    chosen = run(controller, sizes)
    ideal = [richest_meeting_target(s) for s in sizes]          # full to 10 tokens, 3/4 to 14, 1/2 above
    assert {*ideal} == {0, 1, 2}
    # once measured, every step meets T, never at a richer rung than the one that truly meets it, and at
    # most one rung poorer: next to a boundary the richer rung is only extrapolated (below-only), and
    # the controller never steps up on a guess
    assert all(cost(r, s) <= TARGET + 1e-12 for r, s in zip(chosen, sizes))
    assert all(i <= r <= i + 1 for r, i in zip(chosen, ideal)), list(zip(sizes, chosen, ideal))
    assert chosen == [r for r in run(controller, sizes)]        # settled: the same size, the same rung
    by_size = {s: r for s, r in zip(sizes, chosen)}
    assert [by_size[s] for s in sorted(by_size)] == sorted(by_size.values())      # poorer as steps grow


def test_a_big_first_step_steps_down_and_never_guesses_up():
    controller = Controller(LADDER, TARGET)
    assert controller.decide(40) == (0, None)                   # nothing measured: full
    controller.learn(0, 40, cost(0, 40), None)
    assert controller.decide(40)[0] == 1                        # full misses T: the rung below, unmeasured
    controller.learn(1, 40, cost(1, 40), None)
    assert controller.decide(40)[0] == 2
    # full's and 3/4's only measurements (40 tokens) bound them at 2 tokens from above (90 and 70 ms > T):
    # 2 tokens run the poorest rung until a small step measures better, never a guess that full got faster
    assert controller.decide(2)[0] == 2


def test_floors_and_the_fixed_rung():
    controller = Controller(LADDER, TARGET)
    assert controller.floor(None) == 2 and controller.floor(3.0) == 1 and controller.floor(4.0) == 0
    assert controller.floor(3.5) == 0                           # between rungs: the richer one
    assert controller.fixed_rung({1}) == 1 and controller.fixed_rung({0, 2}) is None


def test_overhead_beyond_the_pass_counts_against_the_target():
    controller = Controller(LADDER, TARGET)
    controller.learn(0, 4, cost(0, 4), interval=None)           # 18 ms: meets T
    assert controller.decide(4)[0] == 0
    for _ in range(20):                                          # every token waits 15 ms more than its pass
        assert controller.learn(0, 4, cost(0, 4), interval=cost(0, 4) + 0.015) == pytest.approx(0.033)
    assert controller.decide(4)[0] == 1                          # 18 + 15 > 30: the rung below


@pytest.mark.parametrize("target", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_target_is_refused(target):
    with pytest.raises(AllocMoeError, match="above 0"):
        Controller(LADDER, target)


def test_step_times_interpolate_between_sizes():
    times = StepTimes()
    times.observe(0, 2, 0.02)
    times.observe(0, 6, 0.04)
    assert times.predict(0, 4) == pytest.approx(0.03)
    assert times.predict(1, 4) is None


def test_an_unmeasured_rung_between_two_measured_ones_is_interpolated_by_activations():
    """After a peak the bottom rung is measured and full misses T by a little: the rungs between, never
    run, are estimated linearly in activations between the two, so the controller takes the richest one
    that meets T rather than staying at the bottom. Hand count: full (36) 1.0 s, 1/3 (12) 0.5 s at one
    row; 5/6 (30) is 0.5 + 18/24 x 0.5 = 0.875 <= T = 0.9, so 5/6; with T = 0.8, 2/3 (24): 0.75."""
    ladder = [Rung(0, "full", 36.0), Rung(1, "b56", 30.0), Rung(2, "b23", 24.0), Rung(3, "b12", 18.0),
              Rung(4, "b13", 12.0)]
    for target, expected, seconds in ((0.9, 1, 0.875), (0.8, 2, 0.75), (0.55, 4, 0.5)):
        controller = Controller(ladder, target)
        controller.learn(0, 1, 1.0, None)
        controller.learn(4, 1, 0.5, None)
        rung, predicted = controller.decide(1)
        assert (rung, predicted) == (expected, pytest.approx(seconds))
    controller = Controller(ladder, 0.9)
    controller.learn(0, 1, 1.0, None)
    controller.learn(2, 1, 0.75, None)           # nothing measured below 2/3: 1/2 and 1/3 stay unknown
    assert controller.predictions(1)[3:] == [None, None]
    assert controller.predictions(1)[1] == pytest.approx(0.875)
