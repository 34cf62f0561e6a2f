"""The elastic budget's controller, pure: a ladder of plans, the step times measured per (rung, step
size), and the choice of the richest rung whose predicted step time meets a target T.

Two servers use it: allocmoe's own (`serve/elastic.py`, `allocmoe serve --latency-target-ms`), where a
step's size is its batch's rows, and the vLLM plugin (`integrations/vllm_elastic.py`,
`ALLOCMOE_LATENCY_TARGET_MS`), where it is the step's requests. Each measures its own steps and
hands the seconds here; nothing here reads a clock or a model.

The prediction is `StepTimes`: an EWMA of a step's seconds per (rung, size) plus an EWMA of its
deviation (a bound above the mean, so that a typical step, not only the average one, meets T), plus the
same bound on what a token waits beyond its pass (`Controller.learn`), kept over every step whatever
its rung. A cell not yet measured is estimated from the same rung's measured neighbours in size
(between two: linear; above only: the nearest above, since more rows cost no less; below only: the
nearest below grown as another rung measured at both sizes grows, else in proportion to the size, an
upper bound when a step costs a fixed part plus a part per row). A rung never measured at any size
is estimated between the ladder's rungs that are predicted at that size on both sides of it, linearly
in activations (a step's time grows with the activations it runs; interpolated, never extrapolated).
Without that, a controller that met T at the bottom rung after a peak stayed there while full
missed T by a little, never trying the 5/6 between. A rung with no measured rung poorer than it has no prediction:
it is tried only when stepping *down* (a poorer plan costs no more than a richer one that is already
predicted too slow), never up. Nothing is assumed of the machine: the first steps run full, and the
ladder is walked from what is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AllocMoeError


@dataclass(frozen=True)
class Rung:
    index: int              # the plan's index in the server's own list of plans
    name: str               # its name in usage, records and metrics ("full" for the unmodified model)
    activations: float      # planned activations per token (Plan.budget)


class StepTimes:
    """Measured step seconds per (rung, step size), and the prediction made from them."""

    def __init__(self, alpha: float = 0.25, spread: float = 1.0):
        self.alpha = alpha          # weight of the newest step in each cell's running means
        # deviations added to the mean: a bound above the mean, so a noisy step is not taken for a typical
        # one; 1, not 2, because T is near the one-client step (1.3x in the benchmark) and a bound
        # of two deviations on a shared CPU stepped one client down from full
        self.spread = spread
        self._cells: dict[int, dict[int, list[float]]] = {}     # rung -> size -> [mean, |deviation|, at step]
        self._step = 0                  # steps observed, in any cell

    def observe(self, rung: int, rows: int, seconds: float) -> None:
        self._step += 1
        cell = self._cells.setdefault(rung, {}).get(rows)
        if cell is None:
            self._cells[rung][rows] = [seconds, 0.0, self._step]
            return
        deviation = abs(seconds - cell[0])
        cell[0] += self.alpha * (seconds - cell[0])
        cell[1] = self._deviation(cell) + self.alpha * (deviation - self._deviation(cell))
        cell[2] = self._step

    def _deviation(self, cell: list[float]) -> float:
        """A cell's deviation fades as other cells are measured: a rung left after one slow step is
        tried again once its measured mean meets T (the mean itself is never guessed down)."""
        return cell[1] * (1 - self.alpha) ** (self._step - cell[2])

    def measured(self, rung: int, rows: int) -> float | None:
        cell = self._cells.get(rung, {}).get(rows)
        return None if cell is None else cell[0] + self.spread * self._deviation(cell)

    def predict(self, rung: int, rows: int) -> float | None:
        own = {b: self.measured(rung, b) for b in self._cells.get(rung, {})}
        if rows in own:
            return own[rows]
        below = max((b for b in own if b < rows), default=None)
        above = min((b for b in own if b > rows), default=None)
        if below is not None and above is not None:
            w = (rows - below) / (above - below)
            return own[below] + w * (own[above] - own[below])
        if above is not None:
            return own[above]
        if below is None:
            return None
        growth = [self._between(other, below, rows) for other in self._cells if other != rung]
        growth = [g for g in growth if g is not None]
        return own[below] * (max(growth) if growth else rows / below)

    def _between(self, rung: int, below: int, rows: int) -> float | None:
        """How `rung`'s step time grows from `below` rows to `rows`, where it is measured at `below` and
        measured or bracketed at `rows` (never extrapolated)."""
        cells = self._cells[rung]
        if below not in cells or not any(b >= rows for b in cells):
            return None
        start = self.measured(rung, below)
        return self.predict(rung, rows) / start if start > 0 else None


def check_target(target_seconds: float) -> None:
    if not target_seconds > 0 or target_seconds == float("inf"):
        raise AllocMoeError(f"the latency target must be a number of milliseconds above 0, got "
                            f"{target_seconds * 1000:g}; give e.g. 50")


class Controller:
    """The rung of each step (`decide`) and what each measured step teaches (`learn`); the servers add
    when to ask and whom the answer applies to."""

    def __init__(self, rungs: list[Rung], target_seconds: float, times: StepTimes | None = None):
        check_target(target_seconds)
        if not rungs:
            raise AllocMoeError("an elastic server needs a ladder of at least one plan")
        self.rungs, self.target = rungs, target_seconds
        self.times = times or StepTimes()
        # what a token waits beyond its pass (prefill passes of joining requests, scheduling, sampling):
        # one running [mean, mean |deviation|] over every step, whatever its rung, so it stays current
        self.overhead = [0.0, 0.0]

    def floor(self, min_activations: float | None) -> int:
        """The poorest rung a request with this floor accepts (the full model always qualifies)."""
        if min_activations is None:
            return len(self.rungs) - 1
        ok = [i for i, r in enumerate(self.rungs) if r.activations >= min_activations - 1e-9]
        return max(ok, default=0)

    def decide(self, rows: int) -> tuple[int, float | None]:
        """(rung, its predicted seconds) for a step of size `rows`."""
        extra = self.overhead[0] + self.times.spread * self.overhead[1]
        predicted = [None if p is None else p + extra for p in self.predictions(rows)]
        for i, p in enumerate(predicted):
            if p is not None and p <= self.target:
                return i, p
        known = [i for i, p in enumerate(predicted) if p is not None]
        if not known:
            return 0, None                  # nothing measured yet: full quality
        # every prediction misses T: step down to the richest rung poorer than all of them
        rung = min(known[-1] + 1, len(self.rungs) - 1)
        return rung, predicted[rung]

    def predictions(self, rows: int) -> list[float | None]:
        """Each rung's predicted pass seconds at size `rows` (StepTimes.predict); a rung never measured,
        between two predicted ones, interpolated linearly in activations (module docstring)."""
        own = [self.times.predict(i, rows) for i in range(len(self.rungs))]
        known = [i for i, p in enumerate(own) if p is not None]
        filled = list(own)
        for i in (i for i, p in enumerate(own) if p is None):
            richer = max((j for j in known if j < i), default=None)
            poorer = min((j for j in known if j > i), default=None)
            if richer is None or poorer is None:
                continue
            top, bottom = self.rungs[richer].activations, self.rungs[poorer].activations
            w = (self.rungs[i].activations - bottom) / (top - bottom) if top > bottom else 1.0
            filled[i] = own[poorer] + w * (own[richer] - own[poorer])
        return filled

    def learn(self, rung: int, rows: int, seconds: float, interval: float | None) -> float:
        """One measured step: `seconds` its pass alone, `interval` from the previous step's end to its
        own (None when the server was idle before it). Returns the time per output token it gave."""
        self.times.observe(rung, rows, seconds)
        if interval is None:
            return seconds
        extra, alpha = max(0.0, interval - seconds), self.times.alpha
        self.overhead[1] += alpha * (abs(extra - self.overhead[0]) - self.overhead[1])
        self.overhead[0] += alpha * (extra - self.overhead[0])
        return interval

    def fixed_rung(self, plans: set[int]) -> int | None:
        """The rung a step whose rows all run one of the ladder's plans measures (None: a mix, or a plan
        off the ladder), so that steps without elastic rows still teach the controller."""
        return next((i for i, r in enumerate(self.rungs) if {r.index} == plans), None)
