"""Spending what whole k leave of the budget (calibrate/refine.py `fill_remainder`), by hand: the remainder
B - cost, each layer's raised k = k + r / (1 - u), the cost after it, and the choice among the trials."""

import pytest
import torch

from allocmoe import AllocT, Plan, StaticTopK, allocate
from allocmoe.calibrate.refine import MIN_REMAINDER, fill_remainder
from allocmoe.core.means import ExpertMeans

LAYERS, K_ORIG = [1, 2, 3, 4], 4
U = {2: 0.1, 3: 0.1, 4: 0.1}          # stand-ins on layers 2-4, 0.1 of an expert per skipped slot


def plan_of(ks) -> Plan:
    fp = {"model_type": "olmoe", "num_moe_layers": 4, "num_experts": 8, "k_orig": K_ORIG, "moe_layers": LAYERS}
    plan = Plan(model=fp, layers={i: StaticTopK(k) for i, k in zip(LAYERS, ks)}, method="test", budget=8.0)
    plan.means = ExpertMeans(means={i: torch.zeros(8, 4) for i in U}, tokens=1)
    plan.standins = dict(U)
    return plan


def made_up_ppl(plan: Plan) -> float:
    """Each layer's loss falls with its k; layer 3 gains most from more."""
    gain = {1: 1.0, 2: 2.0, 3: 5.0, 4: 3.0}
    return 100 + sum(gain[i] / p.k for i, p in plan.layers.items())


def test_the_remainder_goes_to_the_layer_where_it_helps_most_and_the_cost_reaches_b():
    plan = plan_of([4, 1, 1, 1])                  # cost 4 + 3 x (1 + 3 x 0.1) = 7.9 of B = 8
    calls = []
    filled, record = fill_remainder(plan, lambda p: calls.append(p) or made_up_ppl(p), 8.0)
    assert record["remainder"] == pytest.approx(0.1)
    raised = 1 + 0.1 / (1 - 0.1)                  # layer 1 is at K: not tried
    assert sorted(record["tried"]) == ["2", "3", "4"] and len(calls) == 4
    by_hand = {i: made_up_ppl(Plan(**{**plan.__dict__, "layers": {**plan.layers, i: AllocT(k=raised, k_base=1)}}))
               for i in (2, 3, 4)}
    assert {int(i): v for i, v in record["tried"].items()} == pytest.approx(by_hand)
    assert record["layer"] == 3 == min(by_hand, key=by_hand.get)
    assert filled.layers[3] == AllocT(k=pytest.approx(raised), k_base=1)
    assert {i: p for i, p in filled.layers.items() if i != 3} == {i: p for i, p in plan.layers.items() if i != 3}
    assert filled.cost()["total"] == pytest.approx(8.0) and filled.cost()["total"] <= 8.0 + 1e-9


def test_a_start_score_given_by_the_caller_saves_the_plans_own_pass():
    plan = plan_of([4, 1, 1, 1])
    calls = []
    filled, record = fill_remainder(plan, lambda p: calls.append(p) or made_up_ppl(p), 8.0, start=made_up_ppl(plan))
    assert len(calls) == 3 and plan not in calls and record["layer"] == 3
    assert record["start_calibration_perplexity"] == pytest.approx(made_up_ppl(plan))
    kept, record = fill_remainder(plan, made_up_ppl, 8.0, start=0.0)      # nothing beats a start of 0
    assert kept is plan and "layer" not in record


def test_nothing_is_taken_where_no_trial_beats_the_plan_or_the_remainder_is_too_small():
    plan = plan_of([4, 1, 1, 1])
    filled, record = fill_remainder(plan, lambda p: 100.0 if p is plan else 101.0, 8.0)
    assert filled is plan and "layer" not in record and len(record["tried"]) == 3
    calls = []
    filled, record = fill_remainder(plan, lambda p: calls.append(p) or 0.0, 7.9 + MIN_REMAINDER / 2)
    assert filled is plan and not calls and "tried" not in record


def test_auto_spends_the_remainder_cross_fitted_within_b(tiny_folder):
    """On a tiny model, auto's plan costs at most B; where a layer was raised, its recorded score is the
    plan's cross-fitted calibration perplexity (two folds, brute force), as every trial's was."""
    from conftest import budget_sensitive_tiny, two_fold_ppl
    from allocmoe.calibrate.profile import profile_sensitivity
    from allocmoe.scoring.perplexity import tokenize_windows

    model, tok, text = budget_sensitive_tiny(tiny_folder, "qwen3_moe")
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False, "refine": 0,
              "substitute_rank": 2}
    profile = profile_sensitivity(model, tok, text, {"seq_len": 64, "calib_tokens": 512, "progress": False})
    windows = tokenize_windows(tok, text, 64, 512)
    taken = 0
    for budget in (5, 7, 9):
        plan = allocate(budget, "auto", profile=profile, model=model, tokenizer=tok, calib_text=text, config=config)
        record = plan.provenance["details"]["remainder"]
        assert plan.cost()["total"] <= budget + 1e-9
        if "layer" in record:
            taken += 1
            assert two_fold_ppl(model, plan, windows) == pytest.approx(record["calibration_perplexity"],
                                                                              rel=1e-6)
            assert record["calibration_perplexity"] < record["start_calibration_perplexity"]
        trials = plan.provenance["details"]["trials"]      # refine 0: the start is the chosen trial's score
        if "tried" in record:
            assert record["start_calibration_perplexity"] == min(t["calibration_perplexity"] for t in trials)
    assert taken                                       # at least one budget left a remainder worth spending
