"""A perplexity target instead of a budget: the bisection finds the smallest whole budget meeting it,
checked against brute force over every budget, on made-up curves and on a tiny model."""

from __future__ import annotations

import pytest
import torch

from allocmoe import AllocMoeError, allocate, apply_plan, evaluate_perplexity
from allocmoe.calibrate.target import parse_target, smallest_budget
from allocmoe.cli import main
from conftest import windows_ppl


def brute_force(curve: dict[int, float], target: float) -> int:
    return min(b for b, p in curve.items() if p <= target)


@pytest.mark.parametrize("target", [101.0, 104.5, 110.0, 130.0, 200.0, 1000.0])
def test_on_a_falling_curve_the_bisection_is_the_brute_force_answer(target):
    layers, k_orig = 3, 4                                   # budgets 3..12
    curve = {b: 100.0 + 90.0 / (b - 2) ** 1.5 for b in range(3, 13)}
    curve[12] = 100.0
    calls = []
    found, tried = smallest_budget(layers, k_orig, target, curve[12], lambda b: calls.append(b) or curve[b])
    assert found == brute_force(curve, target)
    assert len(calls) <= 5 and all(tried[b] == curve[b] for b in tried)      # log2(10) + 1 evaluations


def test_on_a_bumpy_curve_the_answer_meets_the_target_and_the_budget_below_it_does_not():
    curve = {3: 300.0, 4: 180.0, 5: 150.0, 6: 170.0, 7: 140.0, 8: 130.0, 9: 125.0, 10: 121.0, 11: 120.5, 12: 120.0}
    found, tried = smallest_budget(3, 4, 160.0, 120.0, lambda b: curve[b])
    assert curve[found] <= 160.0 and found - 1 in tried and tried[found - 1] > 160.0


def test_targets_are_parsed_and_refused_clearly():
    assert parse_target("5%", 200.0) == pytest.approx(210.0) and parse_target("157", 150.0) == 157.0
    for bad in ("abc", "-1%", "0.5", "nan", "inf%"):
        with pytest.raises(AllocMoeError, match="perplexity target"):
            parse_target(bad, 100.0)
    with pytest.raises(AllocMoeError, match="the full model's calibration perplexity is 150"):
        smallest_budget(3, 4, 140.0, 150.0, lambda b: 1e9)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """An OLMoE-style tiny model whose experts are scaled up, so the budget moves its perplexity."""
    from conftest import budget_sensitive_tiny

    return budget_sensitive_tiny(tiny_folder, "olmoe")


def test_on_a_tiny_model_the_answer_is_checked_against_every_budget_scored_alone(tiny):
    model, tok, text = tiny
    scored = {}
    for budget in range(3, 13):                              # every budget of the 3-layer, K=4 model
        with apply_plan(model, allocate(budget, "uniform", model=model)):
            scored[budget] = evaluate_perplexity(model, tok, text, {"seq_len": 64, "eval_tokens": 512,
                                                                      "progress": False}).perplexity
    target = sorted(scored.values())[4] + 1e-9               # met by some budgets, not by others
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False}
    plan = allocate(method="uniform", target_ppl=f"{target!r}", model=model, tokenizer=tok, calib_text=text,
                    config=config)
    found = plan.provenance["target"]
    for budget, ppl in found["tried"].items():               # what it measured is what scoring alone gives
        assert ppl == pytest.approx(scored[int(budget)], rel=1e-5)
    budget = int(plan.budget)
    assert budget == found["budget_found"] and scored[budget] <= target
    assert budget == 3 or scored[budget - 1] > target         # the budget below it misses the target
    monotone = all(scored[b] >= scored[b + 1] for b in range(3, 12))
    if monotone:
        assert budget == min(b for b in scored if scored[b] <= target)


def test_the_cli_writes_the_plan_with_what_it_found(tiny_folder, tmp_path, capsys):
    out = tmp_path / "plan.json"
    main(["allocate", "--model", str(tiny_folder), "--method", "uniform", "--target-ppl", "10%", "--seq-len", "64",
          "--calib-tokens", "512", "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert "the smallest total budget meeting it is" in err and out.exists()
    from allocmoe import Plan

    plan = Plan.load(out)
    assert plan.provenance["target"]["given"] == "10%" and plan.budget == plan.provenance["target"]["budget_found"]


def test_with_one_moe_layer_the_smallest_budget_is_one_activation_not_the_full_model(tiny):
    """A count of 1 must stay a count: read as a fraction it would be the full budget."""
    from conftest import build_tiny

    _, tok, text = tiny
    model = build_tiny("qwen2_moe", vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=256)
    plan = allocate(method="uniform", target_ppl="1000%", model=model, tokenizer=tok, calib_text=text,
                    config={"seq_len": 64, "calib_tokens": 512, "progress": False})
    assert plan.provenance["target"]["budget_found"] == 1 and plan.budget == 1.0
    assert [policy.k for policy in plan.layers.values()] == [1]


def test_a_bad_method_is_refused_before_any_calibration_pass(tiny, monkeypatch):
    import allocmoe.calibrate.methods as methods

    model, tok, text = tiny
    monkeypatch.setattr(methods, "evaluate_perplexity", lambda *a, **k: pytest.fail("scored before refusing"))
    with pytest.raises(AllocMoeError, match="unknown method 'magic'"):
        allocate(method="magic", target_ppl="5%", model=model, tokenizer=tok, calib_text=text)
    with pytest.raises(AllocMoeError, match="needs a sensitivity profile"):
        allocate(method="alloc-moe", target_ppl="5%", model=model, tokenizer=tok, calib_text=text)


def test_with_stand_ins_the_target_is_judged_on_windows_they_were_not_fitted_on(tiny):
    """Budgets are total cost (activations plus stand-ins): with rank-2 stand-ins on every layer (u = 0.10
    of an expert each) one expert per layer costs 3.92, so the search runs over 4..12. Brute force: each
    budget's plan scored cross-fitted (each half of the windows with stand-ins fitted on the other); the
    target is set where that curve crosses it once, so the smallest budget meeting it is the bisection's
    answer."""
    from conftest import two_fold_ppl

    from allocmoe.calibrate.means import measure_expert_means
    from allocmoe.core.budget import Budget
    from allocmoe.scoring.perplexity import tokenize_windows

    model, tok, text = tiny
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False, "substitute": True,
              "substitute_rank": 2, "standin_fit": "routed"}
    windows = tokenize_windows(tok, text, 64, 512)
    judged = {}
    for count in range(4, 13):
        plan = allocate(Budget(float(count), 12, 3), "uniform", model=model, tokenizer=tok, calib_text=text,
                        config=config)
        judged[count] = two_fold_ppl(model, plan, windows)
    crossing = [b for b in range(5, 12) if min(judged[c] for c in judged if c < b) > max(judged[c] for c in judged
                                                                                        if c >= b)]
    assert crossing, judged
    answer = crossing[len(crossing) // 2]
    target = max(judged[c] for c in judged if c >= answer)
    plan = allocate(method="uniform", target_ppl=f"{target!r}", model=model, tokenizer=tok, calib_text=text,
                    config=config)
    found = plan.provenance["target"]
    assert found["budget_found"] == answer == min(b for b in judged if judged[b] <= target) and plan.budget == answer
    assert found["judged_on"].endswith("cross-fitted (calibrate/crossfit.py)") and found["calibration_tokens"] == 8 * 63
    full = windows_ppl(model, allocate(12, "uniform", model=model), windows)
    assert found["full_calibration_perplexity"] == pytest.approx(full, rel=1e-6)
    assert min(int(b) for b in found["tried"]) == 4
    for budget, ppl in found["tried"].items():
        assert ppl == pytest.approx(judged[int(budget)], rel=1e-5)
    assert found["total_cost"] == pytest.approx(plan.cost()["total"]) and found["total_cost"] <= answer + 1e-9
    assert found["activations"] == sum(p.k for p in plan.layers.values())
    all_means = measure_expert_means(model, windows, 4, rank=2)       # the plan returned: refitted on all
    assert all(torch.equal(plan.means.means[i], all_means.means[i]) for i in all_means.means)
    assert plan.provenance["cross_fit"]["final_means_windows"] == 8


def test_auto_with_a_target_chooses_and_is_judged_on_the_same_held_out_windows(tiny):
    """auto's trials and the target's judging are both cross-fitted the same way (two folds), so the budget
    found is judged by the very score its chosen trial had."""
    from allocmoe.calibrate.profile import profile_sensitivity

    model, tok, text = tiny
    profile = profile_sensitivity(model, tok, text, {"seq_len": 64, "calib_tokens": 512, "progress": False})
    plan = allocate(method="auto", target_ppl="1000%", profile=profile, model=model, tokenizer=tok, calib_text=text,
                    config={"seq_len": 64, "calib_tokens": 512, "progress": False, "refine": 0,
                            "substitute_rank": 2})
    found = plan.provenance["target"]
    assert found["budget_found"] == 3 and "cross-fitted" in found["judged_on"]
    chosen = min(t["calibration_perplexity"] for t in plan.provenance["details"]["trials"])
    assert found["calibration_perplexity"] == pytest.approx(chosen, rel=1e-6)
    assert found["total_cost"] == pytest.approx(plan.cost()["total"]) and plan.cost()["total"] <= 3 + 1e-9


def test_a_target_search_measures_each_windows_means_once_and_gives_the_same_plan(tiny, monkeypatch):
    """The search makes a plan per budget, each scored with stand-ins fitted on the same two halves, then
    refits on all: three measurements (even, odd, all), not two per budget plus one. The plan is the one
    the unmemoised measuring gives (means equal bit for bit); a second allocate() call measures afresh."""
    import allocmoe.calibrate.means as means_module
    from allocmoe.scoring.perplexity import tokenize_windows

    model, tok, text = tiny
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False, "substitute": True,
              "substitute_rank": 2, "standin_fit": "routed"}
    real, calls = means_module.measure_expert_means, []

    def counted(model, windows, *args, **kwargs):
        calls.append(tuple(windows.shape))
        return real(model, windows, *args, **kwargs)

    monkeypatch.setattr(means_module, "measure_expert_means", counted)
    plan = allocate(method="uniform", target_ppl="20%", model=model, tokenizer=tok, calib_text=text, config=config)
    assert len(plan.provenance["target"]["tried"]) >= 2
    assert sorted(calls) == [(4, 64), (4, 64), (8, 64)]
    calls.clear()
    again = allocate(plan.budget / 12, "uniform", model=model, tokenizer=tok, calib_text=text,
                     config={**config, "refine": 1})
    assert sorted(calls) == [(4, 64), (4, 64), (8, 64)]  # a new call, a new memo: the two halves, then all
    fresh = real(model, tokenize_windows(tok, text, 64, 512), 4, rank=2)
    for p in (plan, again):
        assert all(torch.equal(p.means.means[i], fresh.means[i]) for i in p.means.means)
