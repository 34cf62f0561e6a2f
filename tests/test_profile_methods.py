"""Profiling against hand-applied configurations, resuming, and the allocation methods."""


import pytest
import torch

from allocmoe import AllocMoeError, apply_plan, model_fingerprint, static_plan
from allocmoe.scoring import evaluate_perplexity, tokenize_windows
from allocmoe.calibrate.methods import allocate, linear_allocation, spread_evenly
from allocmoe.calibrate.profile import load_profile, profile_cells, profile_sensitivity
from conftest import KillAfter, build_tiny

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(400))


@pytest.fixture(scope="module")
def setup(tok):
    model = build_tiny("qwen3_moe", vocab_size=len(tok))
    return model, tok


CFG = {"seq_len": 32, "calib_tokens": 256, "windows_per_pass": 4, "progress": False}


def test_profile_cells_dedupe_coinciding_configurations():
    cells = profile_cells(num_layers=4, k_orig=3)
    assert len(cells) == 4 * 3 - 3
    assert cells[(3, 1, 1, 1)] == [(0, 3), (1, 1)]


@torch.no_grad()
def test_profile_reproduces_hand_applied_configurations_cell_by_cell(setup):
    model, tok = setup
    profile = profile_sensitivity(model, tok, TEXT, CFG)
    fp = model_fingerprint(model)
    L, K = fp["num_moe_layers"], fp["k_orig"]
    windows = tokenize_windows(tok, TEXT, 32, 256)
    for layer in range(L):
        for k in range(1, K + 1):
            ks = [K] * layer + [k] + [1] * (L - layer - 1)
            with apply_plan(model, static_plan(model, ks)):
                expected = evaluate_perplexity(model, tok, "", {"windows_per_pass": 4, "progress": False}, windows=windows)
            assert profile["sensitivity"][layer][k - 1] == pytest.approx(expected.perplexity, rel=1e-9)


def test_profile_killed_midway_resumes_and_finishes_identically(setup, tmp_path):
    model, tok = setup
    out = tmp_path / "profile.json"
    reference = profile_sensitivity(model, tok, TEXT, CFG)
    with pytest.raises(KeyboardInterrupt):
        profile_sensitivity(model, tok, TEXT, CFG, output=out, on_cell=KillAfter(3))
    assert not out.exists() and (tmp_path / "profile.json.partial.json").exists()
    resumed_calls = []
    resumed = profile_sensitivity(model, tok, TEXT, CFG, output=out, on_cell=lambda l, k: resumed_calls.append(1))
    assert len(resumed_calls) == len(profile_cells(3, 4)) - 3       # only the unfinished cells ran again
    assert resumed["sensitivity"] == reference["sensitivity"]
    assert load_profile(out, model)["sensitivity"] == reference["sensitivity"]
    assert not (tmp_path / "profile.json.partial.json").exists()


def test_a_profile_of_another_model_or_a_corrupt_one_is_refused(setup, tmp_path):
    model, tok = setup
    out = tmp_path / "p.json"
    profile_sensitivity(model, tok, TEXT, CFG, output=out)
    with pytest.raises(AllocMoeError, match="another model"):
        load_profile(out, build_tiny("olmoe"))
    out.write_text(out.read_text()[:40])
    with pytest.raises(AllocMoeError, match="corrupt or truncated"):
        load_profile(out)


def test_budget_only_allocations_sum_to_the_budget():
    assert spread_evenly(14, 4) == [3, 4, 3, 4]
    for total in range(6, 37):
        for asc in (True, False):
            ks = linear_allocation(total, 6, 6, asc)
            assert sum(ks) == total and all(1 <= k <= 6 for k in ks)
            assert ks == sorted(ks, reverse=not asc)


@pytest.mark.parametrize("method", ["uniform", "ascending", "descending", "alloc-t", "alloc-l", "alloc-moe",
                                    "lexi", "top-p", "naee", "auto"])
def test_every_method_makes_a_plan_within_budget(setup, method):
    model, tok = setup
    profile = profile_sensitivity(model, tok, TEXT, CFG)
    plan = allocate("0.5", method, profile=profile, model=model, tokenizer=tok, calib_text=TEXT,
                    config={"seq_len": 32, "calib_tokens": 256})
    fp = model_fingerprint(model)
    budget = fp["num_moe_layers"] * fp["k_orig"] / 2
    assert plan.budget == budget and set(plan.layers) == set(fp["moe_layers"])
    ks = [p.k for p in plan.layers.values()]
    if method not in ("top-p", "naee"):
        assert sum(ks) <= budget + 1e-9
    with apply_plan(model, plan) as handle:
        evaluate_perplexity(model, tok, TEXT, {"seq_len": 32, "eval_tokens": 256, "progress": False})
        measured = handle.activations_per_token()
    if method in ("uniform", "alloc-t"):
        assert measured == pytest.approx(budget)
    else:
        assert measured <= budget * 1.25


def test_auto_is_never_worse_than_the_methods_it_chooses_from(setup):
    model, tok = setup
    profile = profile_sensitivity(model, tok, TEXT, CFG)
    cfg = {"seq_len": 32, "calib_tokens": 256}
    plan = allocate("0.5", "auto", profile=profile, model=model, tokenizer=tok, calib_text=TEXT, config=cfg)
    trials = plan.provenance["details"]["trials"]
    chosen = min(t["calibration_perplexity"] for t in trials)
    windows = tokenize_windows(tok, TEXT, 32, 256)      # a plan without stand-ins scores on every window
    for method in ("alloc-moe", "alloc-l", "alloc-t"):
        other = allocate("0.5", method, profile=profile, model=model, config=cfg)
        with apply_plan(model, other):
            ppl = evaluate_perplexity(model, tok, "", {"progress": False}, windows=windows).perplexity
        assert chosen <= ppl + 1e-9


def test_methods_that_need_a_profile_say_so(setup):
    model, _ = setup
    with pytest.raises(AllocMoeError, match="needs a sensitivity profile"):
        allocate("0.5", "alloc-moe", model=model)
    with pytest.raises(AllocMoeError, match="unknown method"):
        allocate("0.5", "magic", model=model)
