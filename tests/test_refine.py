"""The joint refinement and the allocate add-ons: the budget never moves, calibration never gets worse,
the search ends where no single move helps (checked by brute force), and an interrupted run resumes."""

from __future__ import annotations

import itertools
import json

import math

import pytest

from allocmoe import AllocMoeError, AllocT, Plan, StaticTopK, allocate, apply_plan, evaluate_perplexity
from allocmoe.calibrate.refine import SavedScores, refine_allocation
from allocmoe.cli import main
from conftest import two_fold_ppl, windows_ppl

LAYERS, K_ORIG = [1, 2, 3, 4], 4


def made_up_plan(ks, policy=StaticTopK):
    fp = {"model_type": "olmoe", "num_moe_layers": len(LAYERS), "num_experts": 8, "k_orig": K_ORIG,
          "moe_layers": LAYERS}
    layers = {i: policy(k) if policy is StaticTopK else AllocT(k=k, k_base=1) for i, k in zip(LAYERS, ks)}
    return Plan(model=fp, layers=layers, method="test", budget=float(sum(ks)))


def made_up_ppl(plan: Plan) -> float:
    """Separable costs plus an interaction between layers 2 and 3 (which the profile cannot see)."""
    k = {i: p.k for i, p in plan.layers.items()}
    cost = {1: 9.0, 2: 4.0, 3: 1.0, 4: 6.0}
    return 100 + sum(cost[i] / k[i] for i in k) + 5.0 / (k[2] * k[3])


@pytest.mark.parametrize("start", [[1, 1, 4, 4], [4, 1, 1, 4], [2, 2, 2, 2], [3, 3, 1, 1]])
@pytest.mark.parametrize("policy", [StaticTopK, AllocT])
def test_refinement_keeps_the_budget_improves_and_stops_where_no_move_helps(start, policy):
    plan = made_up_plan(start, policy)
    refined, done = refine_allocation(plan, made_up_ppl, max_evaluations=1000)
    ks = {i: p.k for i, p in refined.layers.items()}
    assert sum(ks.values()) == sum(start) and refined.budget == plan.budget
    assert all(1 <= k <= K_ORIG for k in ks.values()) and type(refined.layers[1]) is policy
    assert made_up_ppl(refined) <= made_up_ppl(plan)
    assert done["calibration_perplexity"] == pytest.approx(made_up_ppl(refined), abs=1e-6)
    for a, b in itertools.permutations(LAYERS, 2):            # brute force: no single move helps any more
        if ks[a] > 1 and ks[b] < K_ORIG:
            moved = made_up_plan([ks[i] - (i == a) + (i == b) for i in LAYERS], policy)
            assert made_up_ppl(moved) >= made_up_ppl(refined)


def test_the_evaluation_bound_is_kept_and_a_bound_of_one_returns_the_start():
    plan = made_up_plan([1, 1, 4, 4])
    calls = []
    refined, done = refine_allocation(plan, lambda p: calls.append(p) or made_up_ppl(p), max_evaluations=7)
    assert len(calls) == done["evaluations"] == 7 and made_up_ppl(refined) < made_up_ppl(plan)
    same, _ = refine_allocation(plan, made_up_ppl, max_evaluations=1)
    assert {i: p.k for i, p in same.layers.items()} == {i: p.k for i, p in plan.layers.items()}


def test_an_interrupted_refinement_resumes_from_its_saved_scores_to_the_same_plan(tmp_path):
    plan = made_up_plan([4, 1, 1, 4])
    whole, _ = refine_allocation(plan, made_up_ppl, max_evaluations=40)
    key = {"run": 1}
    calls = []

    def dies_after_ten(p):
        if len(calls) == 10:
            raise KeyboardInterrupt
        calls.append(p)
        return made_up_ppl(p)

    with pytest.raises(KeyboardInterrupt):
        refine_allocation(plan, dies_after_ten, 40, memo=SavedScores(tmp_path / "r.json", key))
    assert len(json.loads((tmp_path / "r.json").read_text())["scores"]) == 10
    rescored = []
    resumed, done = refine_allocation(plan, lambda p: rescored.append(p) or made_up_ppl(p), 40,
                                      memo=SavedScores(tmp_path / "r.json", key))
    assert {i: p.k for i, p in resumed.layers.items()} == {i: p.k for i, p in whole.layers.items()}
    assert len(rescored) == done["evaluations"] - 10            # the ten saved scores were not redone
    assert len(SavedScores(tmp_path / "r.json", {"run": 2})) == 0   # another run's scores are not reused


def test_a_plan_with_other_policies_is_refused():
    from allocmoe import TopP

    plan = made_up_plan([2, 2, 2, 2])
    plan.layers[1] = TopP(p=0.5)
    with pytest.raises(AllocMoeError, match="refinement moves activations"):
        refine_allocation(plan, made_up_ppl, 10)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from conftest import budget_sensitive_tiny

    return budget_sensitive_tiny(tiny_folder, "qwen3_moe")


def calib_ppl(model, tok, text, plan):
    with apply_plan(model, plan) as handle:
        ppl = evaluate_perplexity(model, tok, text, {"seq_len": 64, "eval_tokens": 512, "progress": False}).perplexity
        return ppl, handle.activations_per_token()


def split_calibration(tok, text):
    """The tiny runs' calibration windows (seq_len 64, 512 tokens: 8) and their (even, odd) halves."""
    from allocmoe.calibrate.crossfit import split_windows
    from allocmoe.scoring.perplexity import tokenize_windows

    windows = tokenize_windows(tok, text, 64, 512)
    return (windows, *split_windows(windows))


def same_means(a, b):
    import torch

    return set(a.means) == set(b.means) and all(torch.equal(a.means[i], b.means[i]) for i in a.means) and \
        all(torch.equal(getattr(a.linear[i], part), getattr(b.linear[i], part))
            for i in (a.linear or {}) for part in ("input_mean", "down", "up"))


def test_on_a_tiny_model_substitute_and_refine_keep_the_budget_exact_and_never_score_worse(tiny):
    """The stand-ins are paid from B (core/budget.py): at rank 2 each costs u = (2*32*2 + 32) / (3*32*16 + 32)
    of an expert on this model (H 32, I 16), so B = 9 of 12 leaves a = floor((9 - 12 u) / (1 - u)) = 8.
    Cross-fitted: the refinement scores every calibration window with stand-ins fitted on the other half
    (two folds), and the plan returned carries stand-ins refitted on all of them."""
    from allocmoe.calibrate.means import measure_expert_means

    model, tok, text = tiny
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False}
    u = 160 / 1568
    activations = math.floor((9 - 12 * u) / (1 - u))
    assert activations == 8
    plain = allocate(activations, "uniform", model=model, config=config)
    plan = allocate(9, "uniform", model=model, tokenizer=tok, calib_text=text,
                    config={**config, "substitute": True, "substitute_rank": 2, "refine": 12, "standin_fit": "routed"})
    windows, even, _ = split_calibration(tok, text)
    even_means, all_means = (measure_expert_means(model, w, 4, rank=2) for w in (even, windows))
    assert plan.means is not None and same_means(plan.means, all_means)
    assert plan.provenance["cross_fit"]["even_windows"] == 4 and plan.provenance["cross_fit"]["odd_windows"] == 4
    _, spent = calib_ppl(model, tok, text, plan)
    start = made = plan.provenance["details"]["refine"]
    assert spent == pytest.approx(activations) and sum(p.k for p in plan.layers.values()) == activations
    assert plan.cost()["total"] == pytest.approx(activations + (12 - activations) * u) and plan.cost()["total"] <= 9
    chosen = allocate(activations, "uniform", model=model, config=config)
    chosen.layers = dict(plan.layers)
    chosen.means = even_means                       # stand-ins on every layer: the folds' means replace these
    assert made["calibration_perplexity"] == pytest.approx(two_fold_ppl(model, chosen, windows), rel=1e-6)
    assert made["calibration_perplexity"] <= start["start_calibration_perplexity"]
    plain_with_means = allocate(activations, "uniform", model=model, config=config)
    plain_with_means.means = even_means
    assert start["start_calibration_perplexity"] == pytest.approx(two_fold_ppl(model, plain_with_means, windows))
    assert windows_ppl(model, plain, windows) != pytest.approx(start["start_calibration_perplexity"])


def test_auto_keeps_the_best_trial_with_or_without_the_substitute_then_refines(tiny):
    """Every choice cross-fitted (two folds), the plan returned with stand-ins fitted on all the windows."""
    from allocmoe.calibrate.means import measure_expert_means

    model, tok, text = tiny
    from allocmoe.calibrate.profile import profile_sensitivity

    profile = profile_sensitivity(model, tok, text, {"seq_len": 64, "calib_tokens": 512, "progress": False})
    # rank 2: a stand-in costs 0.1 of an expert here, so B = 6 of 12 leaves the substitute's trials 5.3 activations
    config = {"seq_len": 64, "calib_tokens": 512, "windows_per_pass": 4, "progress": False, "refine": 8,
              "substitute_rank": 2, "standin_fit": "routed"}
    plan = allocate(6, "auto", profile=profile, model=model, tokenizer=tok, calib_text=text, config=config)
    assert plan.cost()["total"] <= 6 + 1e-9
    details = plan.provenance["details"]
    trials = details["trials"]
    assert {t["substitute"] for t in trials} == {True, False}
    best = min(t["calibration_perplexity"] for t in trials)
    assert details["refine"]["start_calibration_perplexity"] == pytest.approx(best)
    assert (plan.means is not None) == details["chosen"]["substitute"]
    windows, _, _ = split_calibration(tok, text)
    if plan.means is not None:                     # refitted on all the windows, on the chosen layers
        all_means = measure_expert_means(model, windows, 4, rank=2).restricted(sorted(plan.means.means))
        assert same_means(plan.means, all_means)
    assert two_fold_ppl(model, plan, windows) == pytest.approx(details["refine"]["calibration_perplexity"],
                                                                      rel=1e-6)
    off = allocate(6, "auto", profile=profile, model=model, tokenizer=tok, calib_text=text,
                   config={**config, "substitute": False, "refine": 0})
    assert off.means is None and "refine" not in off.provenance["details"] and "cross_fit" not in off.provenance
    assert {t["substitute"] for t in off.provenance["details"]["trials"]} == {False}
    ppl = {(t["method"], t["k_base"]): t["calibration_perplexity"] for t in off.provenance["details"]["trials"]}
    assert ppl[("alloc-l", None)] == pytest.approx(windows_ppl(model, allocate(6, "alloc-l", profile=profile,
                                                                               model=model), windows), rel=1e-6)


def test_the_cli_writes_plan_and_means_and_leaves_no_partial_file(tiny_folder, tmp_path, capsys):
    out = tmp_path / "half.json"
    main(["allocate", "--model", str(tiny_folder), "--method", "uniform", "--budget", "0.5", "--substitute", "--substitute-rank", "2",
          "--refine", "6", "--seq-len", "64", "--calib-tokens", "512", "--output", str(out), "--quiet"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half.json", "half.means.safetensors"]
    plan = Plan.load(out)
    assert plan.means is not None and plan.provenance["details"]["refine"]["evaluations"] <= 6
    main(["eval", "--model", str(tiny_folder), "--plan", str(out), "--seq-len", "64", "--eval-tokens", "256",
          "--quiet"])
    assert "perplexity" in capsys.readouterr().out
    import torch

    from allocmoe import generate, load_model

    model, tok = load_model(tiny_folder)             # generate runs the plan with its means: greedy, as
    stream = generate(model, tok, "And the", plan=str(out), max_new_tokens=8)        # recomputed here
    "".join(stream)
    ids = tok("And the", return_tensors="pt").input_ids
    with torch.no_grad(), apply_plan(model, Plan.load(out)):
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert stream.token_ids == ids[0, -8:].tolist()
    without_means = Plan.load(out)
    without_means.means = without_means.substitute = None
    with torch.no_grad():                                 # and the means changed what the model computes
        assert not torch.equal(_logits_with(model, without_means, ids), _logits_with(model, Plan.load(out), ids))


def _logits_with(model, plan, ids):
    with apply_plan(model, plan):
        return model(ids).logits


@pytest.mark.parametrize("argv, message", [
    (["--method", "top-p", "--substitute"], "--method top-p cannot take --substitute or --refine"),
    (["--method", "naee", "--refine", "4"], "--method naee cannot take --substitute or --refine"),
    (["--method", "uniform", "--refine", "-1"], "--refine"),
])
def test_add_ons_on_methods_that_cannot_take_them_are_refused(tiny_folder, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["allocate", "--model", str(tiny_folder), "--budget", "0.5", "--output", str(tmp_path / "p.json"),
              *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
