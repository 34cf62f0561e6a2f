"""Cross-fitting (calibrate/crossfit.py): every choice scores each calibration window with stand-ins fitted
on the other half (two folds: even and odd windows), and the plan returned carries stand-ins refitted
on all of them."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from allocmoe import AllocMoeError, allocate
from allocmoe.calibrate import methods
from allocmoe.calibrate.crossfit import SPLIT, split_windows
from allocmoe.calibrate.means import fit_skipped_standins, measure_expert_means
from allocmoe.scoring.perplexity import tokenize_windows
from conftest import windows_ppl

RANK = 8


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from conftest import budget_sensitive_tiny

    return budget_sensitive_tiny(tiny_folder, "qwen3_moe")


def equal_means(a, b) -> bool:
    return set(a.means) == set(b.means) and all(torch.equal(a.means[i], b.means[i]) for i in a.means) and all(
        torch.equal(getattr(a.linear[i], part), getattr(b.linear[i], part))
        for i in (a.linear or {}) for part in ("input_mean", "down", "up"))


def test_the_split_alternates_windows_and_refuses_fewer_than_two():
    windows = torch.arange(5 * 3).reshape(5, 3)
    fit, choose = split_windows(windows)
    assert fit[:, 0].tolist() == [0, 6, 12] and choose[:, 0].tolist() == [3, 9]
    with pytest.raises(AllocMoeError, match=r"at least 2 windows: give more --calib-tokens \(calib_tokens; at least 6\)"):
        split_windows(windows[:1])


def run_auto(tiny, monkeypatch, budget: float, config: dict):
    """auto on the over-fitting calibration windows (below), with (each trial, its plan as scored): the
    even windows are one window of the text four times over, the odd windows four others."""
    from allocmoe.calibrate.profile import profile_sensitivity

    model, tok, text = tiny
    windows = tokenize_windows(tok, text, 64, 64 * 8)
    even, odd = windows[0:1].repeat(4, 1), windows[4:8]
    calibration = torch.stack([w for pair in zip(even, odd) for w in pair])        # even, odd, even, ...
    monkeypatch.setattr(methods, "_calibration_windows", lambda *args: calibration)
    made, as_scored, scored = [], [], methods._scored

    def spy(trials, *args):                             # each trial's plan as scored (the chosen one is refitted)
        made.extend(trials)
        as_scored.extend(copy.copy(trial["plan"]) for trial in trials)
        return scored(trials, *args)

    monkeypatch.setattr(methods, "_scored", spy)
    profile = profile_sensitivity(model, tok, text, {"seq_len": 64, "calib_tokens": 512, "progress": False})
    plan = allocate(budget, "auto", profile=profile, model=model, tokenizer=tok, calib_text=text,
                    config={"seq_len": 64, "calib_tokens": 512, "progress": False, "refine": 0, **config})
    monkeypatch.undo()
    return plan, made, as_scored, calibration


def test_every_trial_is_scored_cross_fitted_and_the_best_so_is_chosen(tiny, monkeypatch):
    """Each of auto's 22 trials (stand-ins on every layer or none: 14; the (k, stand-in) menu's at rank 1
    and the (k, rank) menu's, whose layers carry ranks 0-2 around substitute_rank 1: 4 each) is scored
    as brute force scores it: every token, each half
    of the windows with stand-ins fitted by the test on the other half at the trial's own ranks; auto
    keeps the best so."""
    from conftest import fit_at_ranks, two_fold_ppl

    model = tiny[0]
    plan, made, as_scored, calibration = run_auto(tiny, monkeypatch, 6, {"substitute_rank": 1, "rank_menu": True})
    scores = []
    for trial, mine in zip(made, as_scored):
        if mine.means is not None:                     # fold 1's stand-ins, at the trial's ranks
            assert equal_means(mine.means, fit_at_ranks(model, calibration[0::2], mine.means.ranks))
        scores.append(two_fold_ppl(model, mine, calibration))
        assert trial["calibration_perplexity"] == pytest.approx(scores[-1], rel=1e-6)
    assert len(made) == 22 and {t["substitute"] for t in made} == {True, False}
    menus = {t["menu"]: set(t["standin_ranks"].values()) for t in made if t.get("menu")}
    assert menus["k x stand-in"] <= {1} and len(menus["k x stand-in rank"]) > 1          # mixed ranks scored
    chosen = plan.provenance["details"]["chosen"]
    best = min(range(len(made)), key=scores.__getitem__)
    assert scores[made.index(next(t for t in made if all(t.get(k) == v for k, v in chosen.items())))] == min(scores)
    assert chosen["substitute"] == made[best]["substitute"] and chosen["method"] == made[best]["method"]
    provenance = {"split": SPLIT, "even_windows": 4, "odd_windows": 4, "window_tokens": 64, "scored_tokens": 504}
    assert plan.cost()["total"] <= 6 + 1e-9
    if not made[best]["substitute"]:                    # nothing to refit (the final fit: the next tests)
        assert plan.means is None and plan.provenance["cross_fit"] == provenance
        return
    assert plan.provenance["cross_fit"] == {**provenance, "final_means_windows": 8, "final_means_tokens": 512}
    every_means = fit_at_ranks(model, calibration, plan.means.ranks)   # the plan returned: stand-ins fitted on
    shipped = fit_skipped_standins(model, calibration, replace(plan, means=every_means))  # all 8 windows, then on
    assert equal_means(plan.means, shipped)                            # the slots it skips


def test_cross_fitting_never_lets_the_fitted_text_choose(tiny, monkeypatch):
    """With stand-ins on (rank 4, B 5: five trials, each with them on every layer), scored on the text
    they were fitted on (the even windows, one window four times over, with the even windows' stand-ins)
    the trials would pick one that is 0.5+ worse cross-fitted than the one auto picks."""
    from conftest import two_fold_ppl

    model = tiny[0]
    plan, made, as_scored, calibration = run_auto(tiny, monkeypatch, 5, {"substitute_rank": 4, "substitute": True})
    assert len(made) == 5 and all(t["substitute"] for t in made)
    scores = [two_fold_ppl(model, mine, calibration) for mine in as_scored]
    assert [t["calibration_perplexity"] for t in made] == pytest.approx(scores, rel=1e-6)
    in_sample = [windows_ppl(model, mine, calibration[0::2]) for mine in as_scored]   # the trials carry fold 1's
    fitted_text_pick = min(range(len(made)), key=in_sample.__getitem__)
    assert scores[fitted_text_pick] > min(scores) + 0.5                       # a different, worse choice
    chosen, best = plan.provenance["details"]["chosen"], made[scores.index(min(scores))]
    assert (chosen["method"], chosen["k_base"]) == (best["method"], best["k_base"])


def test_the_final_means_are_fitted_on_every_window_and_cost_what_the_chosen_ones_did(tiny):
    model, tok, text = tiny
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False, "substitute": True,
              "substitute_rank": RANK, "refine": 4, "standin_fit": "routed"}
    plan = allocate(10, "alloc-t", model=model, tokenizer=tok, calib_text=text, config=config)
    windows = tokenize_windows(tok, text, 64, 512)
    assert equal_means(plan.means, measure_expert_means(model, windows, 4, rank=RANK))
    assert "standin_fit" not in plan.provenance
    shipped = allocate(10, "alloc-t", model=model, tokenizer=tok, calib_text=text,       # the default fit, from
                       config={**config, "standin_fit": "skipped"})                       # the same plain one
    assert shipped.layers == plan.layers and shipped.cost() == plan.cost()
    assert equal_means(shipped.means, fit_skipped_standins(model, windows, plan))
    assert shipped.provenance["standin_fit"]["final_means_windows"] == 8
    chosen = allocate(10, "alloc-t", model=model, tokenizer=tok, calib_text=text,
                      config={**config, "refine": 0})           # nothing chosen: fitted on all windows at once
    assert "cross_fit" not in chosen.provenance and equal_means(chosen.means, plan.means)
    assert plan.cost()["standins"] == pytest.approx(sum((4 - p.k) * plan.standins[i] for i, p in plan.layers.items()))


def test_one_calibration_window_is_refused_where_stand_ins_are_chosen_on(tiny):
    model, tok, text = tiny
    one = {"seq_len": 64, "calib_tokens": 64, "windows_per_pass": 1, "progress": False}
    with pytest.raises(AllocMoeError, match="give more --calib-tokens"):
        allocate(9, "uniform", model=model, tokenizer=tok, calib_text=text,
                 config={**one, "substitute": True, "refine": 2})
    plan = allocate(9, "uniform", model=model, tokenizer=tok, calib_text=text, config={**one, "refine": 2})
    assert plan.means is None                           # nothing fitted: one window is enough to choose on


def test_a_refinement_partial_file_scored_in_sample_is_not_resumed(tiny_folder, tmp_path):
    """The resume file's key says where its scores were taken: one from before cross-fitting (no
    "scored_on") is started afresh, not reused."""
    from allocmoe.cli import main

    out = tmp_path / "p.json"
    argv = ["allocate", "--model", str(tiny_folder), "--method", "uniform", "--budget", "0.75", "--substitute",
            "--substitute-rank", "2", "--refine", "3", "--seq-len", "64", "--calib-tokens", "512",
            "--output", str(out), "--quiet"]
    seen = {}
    from allocmoe.calibrate import refine

    real = refine.SavedScores.__init__

    def spy(self, path, key):
        real(self, path, key)
        seen.update(key=key, resumed=dict(self))

    partial = tmp_path / "p.json.refine.partial.json"
    import unittest.mock as mock

    with mock.patch.object(refine.SavedScores, "__init__", spy):
        main(argv)
        old_key = {k: v for k, v in seen["key"].items() if k != "scored_on"}
        partial.write_text(json.dumps({"key": old_key, "scores": {"1:1,2:1,3:1": 1.0}}))
        main(argv)
    assert seen["key"]["scored_on"] == SPLIT and seen["resumed"] == {}
    partial.write_text(json.dumps({"key": seen["key"], "scores": {"1:1,2:1,3:1": 1.0}}))
    with mock.patch.object(refine.SavedScores, "__init__", spy):
        main(argv)                                      # the same key, by contrast, is resumed from
    assert seen["resumed"] == {"1:1,2:1,3:1": 1.0}
