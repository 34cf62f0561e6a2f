"""Stronger stand-ins (issue 37 item 3), measured direction by direction on the built-in model.

One fixed allocation per budget: `auto`'s trial family "alloc-moe, k_base 0, stand-ins on every layer"
(at 1/2 the plan `auto` ships: k 5 3 1 2 3 2, 16 activations + 1.76 stand-ins). Every row runs that
same allocation at the same total cost (activations + stand-ins + corrections, in multiply-adds);
only how the skipped slots are stood in for changes. Every fit and choice on calibration text (the
8,192-token split), every reported figure on the test split (16,384 tokens), windows of 512.

  today        rank-8 stand-ins fitted on the full model's inputs (calibrate/means.py; the default until
               the skipped fit below)
  sequential   (a) the same stand-ins refitted bottom-up on the inputs the cut layers below produce
               under the plan (`refit_expert_means`)
  correction   (b) no per-expert stand-ins: one low-rank map per MoE layer, fitted in closed form
               (reduced-rank ridge, core/regression.py) to the layer's output error under the plan
               (full block output minus planned block output on the same input, regressed on that
               input), bottom-up like (a); rank R_l per layer at the stand-ins' cost:
               2 H R_l + H <= (K - k_l) (2 H r + H)
  beside       (b) rank-4 stand-ins plus a correction fitted to what they leave, R_l paying for the
               rank 8 -> 4 saving: 2 H R_l + H <= (K - k_l) 8 H
  chosen       (a) as `auto` could use it: today's fit or the sequential refit, whichever scores better on
               the second half of the calibration windows when both are fitted on the first; then
               fitted on all of them
  ridge        (c) the stand-ins' ridge chosen from 1e-2 (today), 1e-1, 1 by fitting on the first half of
               the calibration windows and scoring the second half; refit on all with the winner
  skipped      the stand-ins fitted where they stand in (`fit_skipped_standins`, the default since): each
               expert on the slots the plan skips, weighted by gate^2, on the plan's inputs, bottom-up

The correction is prototyped here with forward hooks on the MoE blocks: it is not in the plan format.

    python benchmarks/standin_directions.py [--budgets 1/3,1/2,2/3,5/6] [--directions today,sequential,...]
           [--profile PROFILE.json] [--output docs/quality/standin_directions.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

import allocmoe
from allocmoe.calibrate.means import RIDGE, fit_skipped_standins, measure_expert_means, refit_expert_means
from allocmoe.core.budget import standin_multiply_adds
from allocmoe.core.regression import Moments
from allocmoe.routing.adapters import adapter_for_model
from allocmoe.routing.layout import expert_weights
from allocmoe.scoring.perplexity import evaluate_perplexity, tokenize_windows
from machine import cpu_name

SEQ_LEN, CALIB_TOKENS, TEST_TOKENS, RANK = 512, 8192, 16384, 8
RIDGES = (1e-2, 1e-1, 1.0)


class _Stop(Exception):
    """Raised by the recording hook once layer l's block has run: the layers above are not needed."""


class Corrections:
    """Per-MoE-layer whole-error corrections, c_l(x) = offset_l + (x @ down_l) @ up_l added to block l's
    output by a forward hook (x: the block's input [.., H])."""

    def __init__(self, model):
        self.layers = {layer.index: layer for layer in adapter_for_model(model).moe_layers(model)}
        self.terms: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for index, layer in self.layers.items():
            layer.block.register_forward_hook(lambda mod, args, out, i=index: self._add(args[0], out, i))

    def _add(self, x, out, index):
        term = self.terms.get(index)
        if term is None:
            return out
        offset, down, up = term
        return out + (offset + (x @ down) @ up).to(out.dtype)

    @torch.no_grad()
    def fit(self, model, windows, plan, ranks: dict[int, int]) -> None:
        """Bottom-up: for each layer with a rank, run the plan (with the corrections fitted so far) up to
        that layer's block, record its input and planned output, then regress full - planned on the input."""
        self.terms = {}
        hidden = model.config.hidden_size
        for index in sorted(ranks):
            seen = []

            def grab(mod, args, out):
                seen.append((args[0], out))
                raise _Stop

            hook = self.layers[index].block.register_forward_hook(grab)
            with allocmoe.apply_plan(model, plan):
                for batch in windows.split(4):
                    try:
                        model(input_ids=batch)
                    except _Stop:
                        pass
            hook.remove()
            moments = Moments(hidden, hidden)
            for x, planned in seen:                          # the block at full K, outside the plan
                moments.add(x.reshape(-1, hidden), (self.layers[index].block(x) - planned).reshape(-1, hidden))
            x_mean, d_mean, down, up = moments.fit(ranks[index], RIDGE)
            offset = d_mean - (x_mean @ down) @ up
            self.terms[index] = (offset.float(), down.float(), up.float())


def correction_ranks(plan, hidden: int, madds_per_slot: int) -> dict[int, int]:
    """Per layer, the largest R with 2 H R + H <= (K - k_l) x madds_per_slot (capped at H)."""
    ranks = {}
    for index, policy in plan.layers.items():
        room = (plan.k_orig - policy.k) * madds_per_slot
        if room >= hidden:
            ranks[index] = min(hidden, int((room / hidden - 1) // 2))
    return ranks


def equivalents(model, ranks: dict[int, int]) -> float:
    """The corrections' cost per token in activation-equivalents: sum of (2 H R_l + H) / (3 H I + H)."""
    hidden = model.config.hidden_size
    return sum(standin_multiply_adds(hidden, r) for r in ranks.values()) / (expert_weights(model) + hidden)


def ppl(model, windows, plan, corrections=None, terms=None) -> float:
    if corrections is not None:
        corrections.terms = terms or {}
    with allocmoe.apply_plan(model, plan):
        got = evaluate_perplexity(model, None, "", {"progress": False}, windows=windows).perplexity
    if corrections is not None:
        corrections.terms = {}
    return got


def choose_ridge(model, calib, plan) -> tuple[float, dict]:
    """Fit on the first half of the calibration windows, score the second; the ridge that scores best."""
    first, second = calib[: len(calib) // 2], calib[len(calib) // 2:]
    scores = {}
    for ridge in RIDGES:
        plan.means = measure_expert_means(model, first, rank=RANK, ridge=ridge)
        scores[ridge] = ppl(model, second, plan)
    return min(scores, key=scores.get), scores


def choose_refit(model, calib, plan) -> tuple[str, dict]:
    """Today's fit or the sequential refit, whichever scores better on the second half of the calibration
    windows when both are fitted on the first (the choice `auto` can make on calibration text alone)."""
    first, second = calib[: len(calib) // 2], calib[len(calib) // 2:]
    plan.means = measure_expert_means(model, first, rank=RANK)
    scores = {"today": ppl(model, second, plan)}
    plan.means = refit_expert_means(model, first, plan)
    scores["sequential"] = ppl(model, second, plan)
    return min(scores, key=scores.get), scores


def direction_steps(model, calib, plan, today, corrections: Corrections) -> dict:
    """Per direction, a step that sets the plan's stand-ins (and the corrections) and returns what to record."""
    hidden = model.config.hidden_size

    def standins(means):
        plan.means = means
        return {}

    def correction(rank, per_slot):
        plan.means = measure_expert_means(model, calib, rank=rank) if rank else None
        ranks = correction_ranks(plan, hidden, per_slot)
        corrections.fit(model, calib, plan, ranks)
        return {"ranks": ranks, "standin_rank": rank, "correction_equivalents": equivalents(model, ranks)}

    def chosen():
        choice, scores = choose_refit(model, calib, plan)
        plan.means = today
        plan.means = refit_expert_means(model, calib, plan) if choice == "sequential" else today
        return {"chose": choice, "held_out": scores}

    def ridge():
        best, scores = choose_ridge(model, calib, plan)
        plan.means = today if best == RIDGE else measure_expert_means(model, calib, rank=RANK, ridge=best)
        return {"ridge": best, "held_out": {str(r): s for r, s in scores.items()}}

    return {"today": lambda: standins(today),
            "sequential": lambda: standins(refit_expert_means(model, calib, replace(plan, means=today))),
            "correction": lambda: correction(0, hidden * (2 * RANK + 1)),
            "beside": lambda: correction(RANK // 2, hidden * 2 * (RANK - RANK // 2)),
            "chosen": chosen, "ridge": ridge,
            "skipped": lambda: standins(fit_skipped_standins(model, calib, replace(plan, means=today)))}


def run_budget(model, tok, calib_text, calib, test, profile, budget: str, corrections: Corrections,
               directions: list[str]) -> list[dict]:
    started = time.time()                # allocate fits today's stand-ins on the same calibration windows
    plan = allocmoe.allocate(budget, "alloc-moe", profile=profile, model=model, tokenizer=tok, calib_text=calib_text,
                             config={"substitute": True, "k_base": 0, "substitute_rank": RANK, "refine": 0,
                                     "standin_fit": "routed", "seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS,
                                     "progress": False})
    today, fit_today = plan.means, time.time() - started
    steps = direction_steps(model, calib, plan, today, corrections)
    rows = []
    for name in directions:
        started = time.time()
        extra = steps[name]()
        fit_seconds = fit_today if name == "today" else time.time() - started
        started = time.time()
        got = ppl(model, test, plan, corrections, corrections.terms)
        rows.append({"budget": budget, "direction": name, "test": got, "fit_seconds": round(fit_seconds, 1),
                     "k": plan.k_text(), "cost": plan.cost(), **extra})
        print(f"{budget:>4} {name:12} test {got:8.2f}   fit {fit_seconds:6.1f} s, eval {time.time() - started:5.1f} s "
              f"{extra or ''}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1/3,1/2,2/3,5/6")
    parser.add_argument("--profile", type=Path, default=None, help="a profile of the built-in model at these "
                        "settings (allocmoe profile's output) to reuse; default: profile here")
    parser.add_argument("--directions", default="today,sequential,chosen,correction,beside,ridge")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    started = time.time()
    model, tok = allocmoe.load_model()
    calib_text = allocmoe.read_text(None, "calibration")[0]
    calib = tokenize_windows(tok, calib_text, SEQ_LEN, CALIB_TOKENS)
    test = tokenize_windows(tok, allocmoe.read_text(None, "test")[0], SEQ_LEN, TEST_TOKENS)
    profile = (json.loads(args.profile.read_text()) if args.profile else
               allocmoe.profile_sensitivity(model, tok, calib_text, {"seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS,
                                                                     "progress": False}))
    print(f"# built-in model; {cpu_name()}, {args.threads} torch threads, fp32; calibration "
          f"{calib.numel() - calib.size(0)} scored tokens, test {test.numel() - test.size(0)}", flush=True)
    corrections = Corrections(model)
    rows = [row for budget in args.budgets.split(",")
            for row in run_budget(model, tok, calib_text, calib, test, profile, budget, corrections,
                                   args.directions.split(","))]
    print(f"# {time.time() - started:.0f} s")
    if args.output:
        args.output.write_text(json.dumps({"machine": cpu_name(), "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
