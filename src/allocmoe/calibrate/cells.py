"""Running a profile's cells on a loaded model, with the work they cost.

A cell is one configuration of the model scored on the calibration windows. Both profiles run their
cells here: the Alloc-L profile (profile.py: k per MoE layer) and the distinct-expert profile
(distinct.py: one MoE layer at M distinct experts). What differs between them is passed in: where
a cell first differs from the unmodified model, the plan it runs under, how it is scored, and how it
is named on the progress bar.

With the prefix cache (prefix.py) the cells are grouped by the decoder layer they start at and each
runs from the states held there; a model that refuses it runs every cell, from then on, as a full
pass, with a warning. Work is counted in decoder-layer passes (tokens x decoder layers), beside what
full passes for the same cells cost.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any, Callable, Hashable

import torch
from tqdm import tqdm

from ..core.plan import Plan
from ..routing.apply import apply_plan
from .prefix import PrefixCacheUnsupported, PrefixStates, cell_schedule, layer_passes, step_layer_passes

Cell = Hashable


class CellRun:
    """The passes of one profiling run: the prefix-cached schedule when the model allows it, full
    passes otherwise (or from the moment the prefix cache is refused), with the work they cost.

    `windows` [N, S] are the tokens every pass routes (what the prefix cache holds states for and the
    work counts), in batches of `batch_size`. Per cell: `start_layer(cell)` the decoder layer where it
    first differs from the unmodified model, `plan_for(cell)` the plan it runs under, `label(cell)`
    its name on the bar; `score()` scores the model as it stands (the plan applied)."""

    def __init__(self, model, windows: torch.Tensor, batch_size: int, todo: list[Cell], *,
                 start_layer: Callable[[Cell], int], plan_for: Callable[[Cell], Plan], score: Callable[[], float],
                 label: Callable[[Cell], str], prefix_cache: bool = True, facts: dict[str, Any] | None = None):
        self.model, self.start_layer, self.plan_for, self.score, self.label = model, start_layer, plan_for, score, label
        self.prefix_cache = prefix_cache
        self.facts = facts or {}                   # more provenance (how a capped run loaded the model)
        self.num_decoder_layers = int(model.config.num_hidden_layers)
        self.tokens, self.check_tokens = int(windows.numel()), int(windows.size(1))   # the check: one window
        self.prefix: PrefixStates | None = None
        self.refused: str | None = None
        if prefix_cache and todo:
            try:
                self.prefix = PrefixStates(model, windows, batch_size)
            except PrefixCacheUnsupported as exc:
                self._refuse(exc)
        self.steps = self._schedule(todo)
        self.passes, self.naive_passes, self.peak_cache_bytes = 0, 0, 0

    def _schedule(self, cells: list[Cell]):
        return cell_schedule(cells, self.start_layer, self.num_decoder_layers, prefix_cache=self.prefix is not None)

    def planned_passes(self) -> int:
        return layer_passes(self.steps, self.tokens, self.check_tokens)

    def _refuse(self, exc: Exception) -> None:
        self.refused = str(exc)
        print(f"allocmoe: warning: no prefix cache for this model ({exc}); every cell runs the whole model",
              file=sys.stderr)
        self.release()
        self.prefix = None

    def cells(self, bar: "CellBar"):
        """Run the schedule, yielding (cell, perplexity) as each cell finishes."""
        index = 0
        while index < len(self.steps):
            step = self.steps[index]
            try:
                if step.kind == "advance":
                    self.prefix.advance(step.stop)
                elif step.kind == "check":
                    self.prefix.check(step.start)
                else:
                    bar.set_postfix_str(self.label(step.configuration), refresh=False)
                    start = self.prefix.passes_from(step.start) if step.start else nullcontext()
                    with apply_plan(self.model, self.plan_for(step.configuration)):
                        with start:
                            ppl = self.score()
            except PrefixCacheUnsupported as exc:   # the rest of the cells as full passes
                self._refuse(exc)
                rest = [later.configuration for later in self.steps[index:] if later.kind == "cell"]
                self.steps[index:] = self._schedule(rest)
                bar.work_total = self.passes + layer_passes(self.steps[index:], self.tokens, self.check_tokens)
                continue
            work = step_layer_passes(step, self.tokens, self.check_tokens)
            self.passes += work
            bar.work_done += work
            index += 1
            if step.kind == "cell":
                self.naive_passes += self.tokens * self.num_decoder_layers
                yield step.configuration, ppl

    def release(self) -> None:
        if self.prefix is not None:
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.prefix.peak_bytes)
            self.prefix.release()

    def provenance(self) -> dict[str, Any]:
        """Work in decoder-layer passes (tokens x decoder layers) this run made (a step cut short by
        a refusal is not counted), beside what full passes make for the same cells; the most bytes
        of hidden states held at once. Call after `release`."""
        facts = {"prefix_cache": self.prefix_cache and self.refused is None, "layer_passes": self.passes,
                 "naive_layer_passes": self.naive_passes, "decoder_layers": self.num_decoder_layers,
                 "peak_cache_bytes": self.peak_cache_bytes}
        if self.refused:
            facts["prefix_cache_refused"] = self.refused
        return {**facts, **self.facts}


class CellBar(tqdm):
    """Cells done of all cells, with time left from the work left rather than the cells left: a
    cell of a deep layer runs few decoder layers, so counting cells would overstate it."""

    def __init__(self, *args, work_total: int, **kwargs):
        self.work_total, self.work_done = work_total, 0
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        facts = super().format_dict
        cells_left = (facts.get("total") or 0) - facts["n"]
        if self.work_done and facts.get("elapsed") and cells_left > 0:
            seconds_left = (self.work_total - self.work_done) * facts["elapsed"] / self.work_done
            facts["rate"] = cells_left / seconds_left if seconds_left > 0 else None  # tqdm: left = cells / rate
        return facts
