"""auto against its own candidates, on test text (issue 37 item 2: "never worse on test text than the
best of its own candidates by more than noise").

For each model and default budget it runs `auto` as the sweep does, keeps every trial auto scored (a
spy on calibrate/methods.py `_scored`: auto returns only the plan it keeps), ships each trial the way
auto ships its plan (stand-ins refitted on all calibration windows, then on the slots the plan skips:
`_refitted`), and scores auto's plan and every trial on the same test windows as the sweep (the first
16,384 tokens of the test text, windows of 512). It prints, per cell, auto's test perplexity, the
test perplexity of the trial auto chose (before its refinement and remainder), and of the best trial
on test text; auto's plan differs from its chosen trial by the refinement and the remainder.

    PYTHONPATH=src:benchmarks python benchmarks/auto_candidates.py [--models builtin,qwen3_moe]
           [--profiles runs/quality] [--output docs/quality/auto_candidates.json]

--profiles: a quality_cells.py root whose <model>/profile.json is reused (else each model is profiled).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import allocmoe
from allocmoe.calibrate import methods
from allocmoe.calibrate.profile import profile_sensitivity
from allocmoe.core.budget import Budget
from allocmoe.routing.apply import apply_plan
from allocmoe.routing.layout import model_fingerprint
from allocmoe.scoring.perplexity import evaluate_perplexity, tokenize_windows, window_len
from machine import cpu_name
from quality_cells import MODELS, TEXTS

BUDGETS = ("1/3", "1/2", "2/3", "5/6")
TEST_TOKENS, WINDOW = 16384, 512          # the sweep's defaults


def candidates(name: str, profiles: Path | None) -> list[dict]:
    model, tok = allocmoe.load_model(MODELS[name])
    calib_file, test_file = TEXTS.get(name, (None, None))
    calib, _ = allocmoe.read_text(calib_file, "calibration")
    test, _ = allocmoe.read_text(test_file, "test")
    saved = profiles / name / "profile.json" if profiles else None
    profile = (json.loads(saved.read_text()) if saved and saved.is_file()
               else profile_sensitivity(model, tok, calib, {"progress": False}))
    windows = tokenize_windows(tok, test, window_len(model, WINDOW), TEST_TOKENS)

    def test_ppl(plan) -> float:
        with apply_plan(model, plan):
            return evaluate_perplexity(model, None, "", {"windows_per_pass": 4, "progress": False},
                                       windows=windows).perplexity

    fingerprint = model_fingerprint(model)
    config = methods.AllocateConfig(progress=False)
    rows = []
    for fraction in BUDGETS:
        budget = Budget.parse(fraction, fingerprint["num_moe_layers"], fingerprint["k_orig"])
        made, scored = [], methods._scored

        def spy(trials, *args):
            made.extend((trial, copy.copy(trial["plan"])) for trial in trials)
            return scored(trials, *args)

        methods._scored = spy
        try:
            plan = allocmoe.allocate(budget, "auto", profile=profile, model=model, tokenizer=tok, calib_text=calib,
                                     config=config)
        finally:
            methods._scored = scored
        trials = []
        for trial, as_scored in made:
            shipped = copy.copy(as_scored)
            if shipped.means is not None:           # as auto ships: refit on all windows, then on skipped slots
                shipped.provenance = {"cross_fit": {}}
                with methods._means_memo():
                    shipped = methods._refitted(shipped, model, tok, calib, config)
            trials.append({**{k: v for k, v in trial.items() if k != "plan"}, "test_perplexity": test_ppl(shipped)})
        chosen = min(trials, key=lambda t: t["calibration_perplexity"])
        best = min(trials, key=lambda t: t["test_perplexity"])
        rows.append({"budget": fraction, "auto": test_ppl(plan), "chosen_trial": chosen["test_perplexity"],
                     "best_trial": best["test_perplexity"], "trials": trials})
        print(f"{name} {fraction}: auto {rows[-1]['auto']:.3f}, its chosen trial {chosen['test_perplexity']:.3f}, "
              f"best trial {best['test_perplexity']:.3f} ({best['method']}, k_base {best['k_base']}, "
              f"stand-ins {best['substitute']}{', ' + best['menu'] if best.get('menu') else ''}); "
              f"auto - best {rows[-1]['auto'] - best['test_perplexity']:+.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--profiles", type=Path, default=None, help="a quality_cells.py root to take profiles from")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--output", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    summary = {"machine": cpu_name(), "threads": args.threads, "models": {}}
    for name in args.models.split(","):
        started = time.time()
        summary["models"][name] = {"cells": candidates(name, args.profiles), "seconds": round(time.time() - started, 1)}
        if args.output:
            args.output.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
