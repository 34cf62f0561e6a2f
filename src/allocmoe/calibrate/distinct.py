"""The latency budget's allocation: how many distinct experts each MoE layer may load per decode step.

In memory-bound batched decoding a step costs the distinct experts it loads per layer (the union
over the batch), which the `distinct` policy caps at M_l (core/policies.py DistinctExperts). This
module chooses the M_l, from a profile measured at the decode batch size B:

  unrestricted union   per MoE layer, the mean and max distinct experts per decode step at full
                       top-K on the calibration windows, grouped as `eval --decode-batch B` groups
                       them (B windows side by side, one position of each per step)
  distinct profile     S[l][M-1] for M = 1..E: calibration perplexity, same grouping, with MoE layer
                       l at DistinctExperts(M, k_floor) and every other layer at full top-K. At M at or
                       above layer l's max union every step keeps its full top-K, which is the
                       unrestricted model exactly, so those cells are not run: they hold the
                       unrestricted perplexity. Cells run: sum over layers of (max union - 1), or
                       fewer with `m_step` (every m_step-th M measured, linear in between).
  allocation           a total T of distinct experts per step summed over the MoE layers, either a
                       fraction of the summed mean unions, T = round(f * sum_l U_l), or an average
                       count per layer c > 1, T = round(c * L); the M_l minimising sum_l S[l][M_l]
                       with sum_l M_l <= T by the same exact DP as Alloc-L (option M costs M units).

The profile reuses the Alloc-L profile's prefix cache (calibrate/prefix.py): before layer l every
cell runs the unmodified model, so the states entering layer l are computed once, and each cell runs
from there, to the same numbers. Finished cells are kept in a resume file after every cell, so an
interrupted run recomputes at most the cell it was in. Work is counted in decoder-layer passes
(tokens x decoder layers), beside what full passes would cost.

Not here: the policy (core/policies.py), the grouping (scoring/perplexity.py), the DP
(core/solver.py). A plan's `budget` (activations per token) is the full L*K: it bounds experts
per step, not activations.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time

from pathlib import Path
from typing import Any, Callable

import torch

from ..core.budget import read_fraction_or_count, round_half_up
from ..core.config import Config, check_counts, checked_config
from ..core.plan import Plan, check_fingerprint
from ..routing.layout import model_fingerprint
from ..core.policies import DistinctExperts, StaticTopK
from ..core.solver import solve_allocation
from ..errors import AllocMoeError
from ..scoring.perplexity import (check_decode_batch, default_seq_len, evaluate_perplexity,
                                  tokenize_windows, window_len)
from ..routing.apply import apply_plan, static_plan
from .cells import CellBar, CellRun
from .profile import resumed_cells, score_cells, with_weights

PROFILE_KIND = "distinct"


class DistinctConfig(Config):
    """How the distinct-expert profile is measured: the decode batch it bounds, its grid, calibration."""
    __config_aliases__ = {"calib_max_tokens": "calib_tokens"}     # deprecated names

    decode_batch: int = 16          # sequences decoded side by side: the step whose experts the budget bounds
    k_floor: int = 1                # each token's top experts chosen before any others (DistinctExperts)
    calib_tokens: int = 8192        # calibration tokens scored per cell
    seq_len: int | None = None      # window; None = min(the model's default, calib_tokens // decode_batch)
    m_step: int = 1                 # profile every m_step-th M (1: every M; between them, linear interpolation)
    prefix_cache: bool = True       # each cell starts at its layer from states computed once: same numbers, less work
    progress: bool = True           # progress bar over the cells (stderr)

    def __post_init__(self):
        check_counts(self, {"decode_batch": 1, "k_floor": 1, "calib_tokens": 2, "seq_len": 2, "m_step": 1})


# -- the budget as typed -------------------------------------------------------------------------
def parse_distinct_budget(text: str | float, num_experts: int,
                          num_layers: int = 1) -> tuple[float | None, float | None]:
    """"0.5", "1/2", "50%" (a fraction of the unrestricted union) -> (fraction, None); a number
    > 1 (distinct experts per step per MoE layer on average, at most E) -> (None, count). Same
    rule as activation budgets: "/", "%" or a number <= 1 is a fraction."""
    raw = str(text).strip()
    try:
        value, is_fraction = read_fraction_or_count(raw)
    except ValueError:
        raise AllocMoeError(f"--max-distinct-experts {raw!r} is not a number; give a fraction of the unrestricted "
                            f"union (0.5, 1/2, 50%) or an average count of distinct experts per layer and step "
                            f"(e.g. {num_experts // 2} of {num_experts})") from None
    if not value > 0 or not math.isfinite(value):
        raise AllocMoeError(f"--max-distinct-experts {raw!r} must be positive; give a fraction in (0, 1] or a "
                            f"count above 1 and at most {num_experts}")
    if is_fraction:
        if value > 1:
            raise AllocMoeError(f"--max-distinct-experts {raw!r} is a fraction above 1; give at most 1 (100%)")
        if round_half_up(value * num_layers * num_experts) < num_layers:     # whatever the union turns out to be
            raise AllocMoeError(f"--max-distinct-experts {raw!r} leaves less than one distinct expert per layer "
                                f"even where every step loads all {num_experts}; give at least "
                                f"{(num_layers - 0.5) / (num_layers * num_experts):.3g}")
        return value, None
    if value > num_experts:
        raise AllocMoeError(f"--max-distinct-experts {raw!r} is more than this model's {num_experts} experts per "
                            f"layer; give at most {num_experts}")
    return None, value


def distinct_total(fraction: float | None, count: float | None, union_mean: list[float], raw: str = "") -> int:
    """T, distinct experts per step summed over the MoE layers: round(f * sum of mean unions) or
    round(count * L); refused below L (every layer keeps one expert)."""
    num_layers = len(union_mean)
    total = round_half_up(fraction * sum(union_mean)) if fraction is not None else round_half_up(count * num_layers)
    if total < num_layers:
        union = sum(union_mean)
        raise AllocMoeError(f"--max-distinct-experts {raw or fraction} of the unrestricted union ({union:.1f} distinct "
                            f"experts per step over the {num_layers} MoE layers) is {total}, below {num_layers} "
                            f"(one per layer); give at least {(num_layers - 0.5) / union:.3g}")
    return total


def check_k_floor(k_floor: int, k_orig: int) -> None:
    if k_floor > k_orig:
        raise AllocMoeError(f"k_floor (--k-floor) {k_floor} is above this model's K = {k_orig} experts per token; "
                            f"give 1..{k_orig}")


# -- calibration windows -------------------------------------------------------------------------
def distinct_seq_len(model, config: DistinctConfig) -> int:
    """The window: `seq_len`, or the longest that still gives `decode_batch` windows from
    `calib_tokens` tokens (at most the model's default)."""
    if config.seq_len is not None:
        return window_len(model, config.seq_len)
    seq_len = min(default_seq_len(model), config.calib_tokens // config.decode_batch)
    if seq_len < 2:
        raise AllocMoeError(f"--calib-tokens {config.calib_tokens} gives fewer than 2 tokens per window at "
                            f"--decode-batch {config.decode_batch}; give at least {2 * config.decode_batch} "
                            "calibration tokens or a smaller --decode-batch")
    return seq_len


def distinct_windows(model, tokenizer, calib_text: str, config: DistinctConfig) -> torch.Tensor:
    """The calibration windows [N, S], refused when fewer than `decode_batch` (works on a skeleton)."""
    windows = tokenize_windows(tokenizer, calib_text, distinct_seq_len(model, config), config.calib_tokens)
    check_decode_batch(windows, config.decode_batch)
    return windows


# -- the profile ---------------------------------------------------------------------------------
def profile_grid(max_union: int, m_step: int) -> list[int]:
    """The M run for a layer of this max union: 1, 1 + m_step, ... below it (at it: the unrestricted model)."""
    return list(range(1, max_union, m_step))


def _cell_plan(fingerprint: dict[str, Any], position: int, max_experts: int, k_floor: int) -> Plan:
    """MoE layer `position` at DistinctExperts(M, k_floor), every other at full top-K."""
    k_orig, indices = fingerprint["k_orig"], fingerprint["moe_layers"]
    layers = {index: StaticTopK(k_orig) for index in indices}
    layers[indices[position]] = DistinctExperts(max_experts, k_floor)
    return Plan(model=fingerprint, layers=layers, method="distinct-profile",
                budget=float(len(indices) * k_orig))


def _score(model, windows: torch.Tensor, decode_batch: int) -> float:
    return evaluate_perplexity(model, None, "", {"decode_batch": decode_batch, "progress": False},
                               windows=windows).perplexity


@torch.no_grad()
def measure_union(model, windows: torch.Tensor, decode_batch: int) -> tuple[float, list[float], list[int]]:
    """(perplexity, mean union per MoE layer, max union per MoE layer) at full top-K, the windows
    scored `decode_batch` side by side."""
    fingerprint = model_fingerprint(model)
    full = static_plan(model, [fingerprint["k_orig"]] * fingerprint["num_moe_layers"], method="full")
    with apply_plan(model, full) as handle:
        ppl = _score(model, windows, decode_batch)
        counted = handle.layer_distinct_experts()
    per_layer = [counted[index] for index in fingerprint["moe_layers"]]
    return ppl, [v["mean"] for v in per_layer], [int(v["max"]) for v in per_layer]


def distinct_profile(model, tokenizer, calib_text: str, config: DistinctConfig | dict | None = None,
                     resume_file: str | os.PathLike | None = None, calib_name: str = "text",
                     on_union: Callable[[list[float]], Any] | None = None) -> dict[str, Any]:
    """The distinct profile (module docstring) of a loaded model on `calib_text`.

    `resume_file` keeps finished cells (a rerun with the same model, text and settings skips them);
    it is deleted once the profile is complete. `on_union(mean union per layer)` is called after the
    unrestricted pass, before the first cell: it may refuse (raise) what the union makes impossible.
    Returns {"kind": "distinct", "model", "decode_batch", "k_floor", "num_experts", "calibration",
    "unrestricted_perplexity", "union_mean", "union_max", "measured" (the M run per layer),
    "sensitivity" (L x E), "provenance" (cells, passes, time)}."""
    config = checked_config(DistinctConfig, config)
    _check_arguments("distinct_profile", model, tokenizer, calib_text)
    fingerprint = model_fingerprint(model)
    num_layers, num_experts = fingerprint["num_moe_layers"], fingerprint["num_experts"]
    check_k_floor(config.k_floor, fingerprint["k_orig"])
    windows = distinct_windows(model, tokenizer, calib_text, config)
    fill = check_decode_batch(windows, config.decode_batch)
    routed = torch.cat([windows, windows[:fill]]) if fill else windows                 # [N + fill, S]
    calibration = _calibration(calib_name, calib_text, windows, fill, config)
    started = time.time()
    unrestricted, union_mean, union_max = measure_union(model, windows, config.decode_batch)
    if on_union is not None:
        on_union(union_mean)
    grids = [profile_grid(min(m, num_experts), config.m_step) for m in union_max]
    cells = [(position, m) for position, grid in enumerate(grids) for m in grid]

    run_key = {"kind": PROFILE_KIND, "model": with_weights(fingerprint, model), "calibration": calibration,
               "decode_batch": config.decode_batch, "k_floor": config.k_floor}
    resume = Path(resume_file) if resume_file else None
    done = resumed_cells(resume, run_key, "distinct profile resume file") if resume else {}
    todo = [cell for cell in cells if _key(cell) not in done]
    run = _cell_run(model, windows, routed, config, fingerprint, todo)
    if config.progress:
        _announce(len(cells), len(todo), num_layers, calibration["tokens_scored"], config, run, routed.numel())
    bar = CellBar(total=len(cells), initial=len(cells) - len(todo), desc="distinct profile", unit="cell",
                  bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
                  disable=not config.progress, work_total=run.planned_passes())
    try:
        score_cells(run, bar, done, resume, run_key, len(cells), what="distinct-profile cells")
    finally:
        bar.close()
        run.release()

    sensitivity = [_interpolated([(m, done[_key((position, m))]) for m in grid]
                                 + [(min(union_max[position], num_experts), unrestricted)], num_experts)
                   for position, grid in enumerate(grids)]
    profile = {
        "kind": PROFILE_KIND, "model": fingerprint, "decode_batch": config.decode_batch, "k_floor": config.k_floor,
        "num_experts": num_experts, "metric": "perplexity", "calibration": calibration,
        "unrestricted_perplexity": unrestricted, "union_mean": union_mean, "union_max": union_max,
        "measured": grids, "sensitivity": sensitivity,
        "provenance": {"cells": len(cells), "cells_resumed": len(cells) - len(todo),
                       "seconds_this_run": round(time.time() - started, 1), "config": config.model_dump(),
                       "torch_threads": torch.get_num_threads(),
                       **_with_unrestricted(run.provenance(), routed.numel())},
    }
    if resume and resume.exists():
        resume.unlink()
    return profile


def _calibration(calib_name: str, calib_text: str, windows: torch.Tensor, fill: int,
                 config: DistinctConfig) -> dict[str, Any]:
    """The profile's `calibration` facts (the file keeps the key `max_tokens` for --calib-tokens)."""
    return {"text": calib_name, "sha256": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
            "tokens_scored": int(windows.numel() - windows.size(0)), "windows": int(windows.size(0)),
            "top_up_windows": fill, "seq_len": int(windows.size(1)), "max_tokens": config.calib_tokens}


def _announce(cells: int, todo: int, num_layers: int, tokens: int, config: DistinctConfig, run, routed: int) -> None:
    """The line on stderr that says how much work the distinct profile is, before it starts."""
    print(f"distinct profile: {cells} cells ({todo} to run) over {num_layers} MoE layers, "
          f"{tokens} calibration tokens at decode batch {config.decode_batch}, about "
          f"{run.planned_passes() / max(1, routed * run.num_decoder_layers):.0f} full-pass equivalents",
          file=sys.stderr)


def _interpolated(points: list[tuple[int, float]], num_experts: int) -> list[float]:
    """S[M-1] for M = 1..E from measured (M, value) points in increasing M (the last one the max
    union: the unrestricted value, held above it), linear between measured points."""
    row = []
    for m in range(1, num_experts + 1):
        if m >= points[-1][0]:
            row.append(points[-1][1])
            continue
        upper = next(i for i, (at, _) in enumerate(points) if at >= m)
        (m1, v1), (m2, v2) = points[max(upper - 1, 0)], points[upper]
        row.append(v2 if m2 == m or m2 == m1 else v1 + (v2 - v1) * (m - m1) / (m2 - m1))
    return row


def _key(cell: tuple[int, int]) -> str:
    return f"{cell[0]},{cell[1]}"


def _cell_run(model, windows: torch.Tensor, routed: torch.Tensor, config: DistinctConfig,
              fingerprint: dict[str, Any], todo: list[tuple[int, int]]) -> CellRun:
    """The profile's cells (cells.py): cell (position, M) starts at its MoE layer; the prefix cache
    holds the states of `routed` (the windows topped up to whole decode batches, as scoring runs them)."""
    moe_layers = fingerprint["moe_layers"]
    return CellRun(
        model, routed, config.decode_batch, sorted(todo), prefix_cache=config.prefix_cache,
        start_layer=lambda cell: moe_layers[cell[0]],
        plan_for=lambda cell: _cell_plan(fingerprint, cell[0], cell[1], config.k_floor),
        score=lambda: _score(model, windows, config.decode_batch),
        label=lambda cell: f"MoE layer {cell[0] + 1}/{len(moe_layers)} M={cell[1]}")


def _with_unrestricted(facts: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The run's work with the unrestricted pass (one full pass, in both counts) added."""
    full = tokens * facts["decoder_layers"]
    return {**facts, "layer_passes": facts["layer_passes"] + full,
            "naive_layer_passes": facts["naive_layer_passes"] + full}


def check_distinct_profile(profile: Any, fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
    """A distinct profile (from `distinct_profile`) checked for what the allocation reads."""
    if not (isinstance(profile, dict) and profile.get("kind") == PROFILE_KIND):
        raise AllocMoeError("the profile is not a distinct profile (an Alloc-L profile cannot bound distinct "
                            "experts); make one with allocmoe.distinct_profile(model, tokenizer, text)")
    if fingerprint is not None:
        check_fingerprint(profile["model"], fingerprint, "the distinct profile")
    num_layers, num_experts = profile["model"]["num_moe_layers"], profile["num_experts"]
    table = profile.get("sensitivity")
    if not (isinstance(table, list) and len(table) == num_layers and all(
            isinstance(row, list) and len(row) == num_experts for row in table)
            and len(profile.get("union_mean") or []) == num_layers):
        raise AllocMoeError(f"the distinct profile's table is not {num_layers} MoE layers x {num_experts} experts; "
                            "make it again with allocmoe.distinct_profile")
    return profile


# -- the allocation ------------------------------------------------------------------------------
def _check_arguments(function: str, model, tokenizer, calib_text) -> None:
    """A loaded model, its tokenizer and a calibration text, at the door."""
    from ..core.config import check_model_argument, check_tokenizer_argument
    from ..texts import check_text

    check_model_argument(function, model)
    check_tokenizer_argument(function, tokenizer)
    check_text(calib_text, f"{function}: calib_text")


def allocate_distinct(max_distinct_experts: str | float, *, profile: dict | None = None, model=None, tokenizer=None,
                      calib_text: str | None = None, config: DistinctConfig | dict | None = None,
                      resume_file: str | os.PathLike | None = None, calib_name: str = "text") -> Plan:
    """A latency-budget plan: DistinctExperts(M_l, k_floor) per MoE layer, the M_l from the exact DP
    on the distinct profile with sum_l M_l <= T (module docstring for T).

    `max_distinct_experts`: a fraction of the unrestricted union ("0.5", "1/2", "50%") or an average
    count of distinct experts per layer and step (> 1, at most E). Give a `profile` from
    `distinct_profile` (pure: many budgets, one profile; its decode batch and k_floor are used), or
    the model, its tokenizer and calibration text to measure one (`config`, `resume_file`)."""
    given_config = config
    config = checked_config(DistinctConfig, config)
    from ..core.config import check_argument

    check_argument("allocate_distinct", "max_distinct_experts", max_distinct_experts, str | int | float,
                   "a fraction (0.5, '1/2', '50%') or a count", finite=False)
    if profile is not None and not isinstance(profile, dict):
        raise AllocMoeError(f"allocate_distinct: profile must be the dict distinct_profile returns, got "
                            f"{type(profile).__name__}; give that dict, or the model, tokenizer and calib_text")
    if profile is None:
        if model is None or tokenizer is None or calib_text is None:
            raise AllocMoeError("a distinct-expert allocation needs a distinct profile, or the model, its tokenizer "
                                "and calibration text to measure one; pass profile=, or model=, tokenizer= and "
                                "calib_text=")
        _check_arguments("allocate_distinct", model, tokenizer, calib_text)
        fingerprint = model_fingerprint(model)
        fraction, count = parse_distinct_budget(max_distinct_experts, fingerprint["num_experts"],
                                                fingerprint["num_moe_layers"])
        def refuse_early(union_mean):       # a fraction too small for this union: before the first cell
            distinct_total(fraction, count, union_mean, str(max_distinct_experts))

        profile = distinct_profile(model, tokenizer, calib_text, config, resume_file, calib_name, on_union=refuse_early)
    else:
        check_distinct_profile(profile, model_fingerprint(model) if model is not None else None)
        fingerprint = profile["model"]
        if given_config is not None and (config.decode_batch, config.k_floor) != (profile["decode_batch"],
                                                                                  profile["k_floor"]):
            raise AllocMoeError(f"the distinct profile was measured at decode batch {profile['decode_batch']} with "
                                f"k_floor {profile['k_floor']}, not {config.decode_batch} and {config.k_floor}; "
                                "measure a profile at these settings, or leave config out")
        fraction, count = parse_distinct_budget(max_distinct_experts, fingerprint["num_experts"],
                                                fingerprint["num_moe_layers"])
    total = distinct_total(fraction, count, profile["union_mean"], str(max_distinct_experts))
    max_experts = solve_allocation(profile["sensitivity"], total)
    indices = fingerprint["moe_layers"]
    layers = {index: DistinctExperts(m, profile["k_floor"]) for index, m in zip(indices, max_experts)}
    details = {"max_distinct_experts": str(max_distinct_experts), "decode_batch": profile["decode_batch"],
               "k_floor": profile["k_floor"], "total": total, "allocated": sum(max_experts),
               "union_mean": [round(u, 4) for u in profile["union_mean"]], "union_max": profile["union_max"],
               "unrestricted_calibration_perplexity": profile["unrestricted_perplexity"],
               "calibration": profile["calibration"], "measured": profile["measured"],
               "sensitivity": profile["sensitivity"], "profile": profile.get("provenance", {})}
    return Plan(model=fingerprint, layers=layers, method="distinct",
                budget=float(fingerprint["num_moe_layers"] * fingerprint["k_orig"]),
                provenance={"details": details})
