"""The latency budget's allocation (calibrate/distinct.py, issue 23 part 2): the unrestricted union
counted independently, the profile's cells against plain perplexity runs, the DP against brute force,
resuming, and the CLI end to end (allocate --max-distinct-experts, then eval --decode-batch)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from allocmoe import AllocMoeError, DistinctExperts, Plan, allocate, allocate_distinct, apply_plan, distinct_profile
from allocmoe import evaluate_perplexity, load_model, static_plan
from allocmoe.calibrate import distinct as distinct_module
from allocmoe.calibrate.cells import CellRun
from allocmoe.calibrate.distinct import distinct_total, parse_distinct_budget, profile_grid
from allocmoe.cli import main
from allocmoe.core.policies import StaticTopK
from allocmoe.core.solver import solve_allocation
from allocmoe.scoring.perplexity import tokenize_windows
from allocmoe.texts import read_text

B, SEQ, TOKENS = 4, 32, 256          # 8 calibration windows of 32 tokens, decoded 4 side by side
CONFIG = {"decode_batch": B, "seq_len": SEQ, "calib_tokens": TOKENS, "progress": False}


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    model, tok = load_model(tiny_folder)
    text, _ = read_text(None, "calibration")
    return model, tok, text


@pytest.fixture(scope="module")
def profile(tiny):
    model, tok, text = tiny
    return distinct_profile(model, tok, text, CONFIG)


def _windows(tok, text):
    return tokenize_windows(tok, text, SEQ, TOKENS)


def _ppl(model, plan, windows) -> float:
    with apply_plan(model, plan):
        return evaluate_perplexity(model, None, "", {"decode_batch": B, "progress": False}, windows=windows).perplexity


def _one_layer_capped(model, position: int, m: int) -> Plan:
    full = static_plan(model, [4, 4, 4])
    layers = {index: StaticTopK(4) for index in full.layers}
    layers[sorted(layers)[position]] = DistinctExperts(m, 1)
    return Plan(model=full.model, layers=layers, method="test", budget=12.0)


def test_the_budget_parses_as_a_fraction_of_the_union_or_an_average_count():
    assert parse_distinct_budget("0.5", 8, 3) == (0.5, None)
    assert parse_distinct_budget("1/4", 8, 3) == (0.25, None)
    assert parse_distinct_budget("50%", 8, 3) == (0.5, None)
    assert parse_distinct_budget("1", 8, 3) == (1.0, None)
    assert parse_distinct_budget("3", 8, 3) == (None, 3.0)
    assert parse_distinct_budget("2.5", 8, 3) == (None, 2.5)
    for text, message in [("abc", "is not a number"), ("nan", "is not a number"), ("0", "must be positive"),
                          ("-1", "must be positive"),
                          ("150%", "fraction above 1"), ("9", "more than this model's 8 experts"),
                          ("0.05", "less than one distinct expert per layer")]:
        with pytest.raises(AllocMoeError, match=message):
            parse_distinct_budget(text, 8, 3)
    assert distinct_total(0.5, None, [7.5, 7.0, 7.25]) == round(0.5 * 21.75)
    assert distinct_total(None, 2.5, [7.5, 7.0, 7.25]) == 8          # round half up of 7.5
    with pytest.raises(AllocMoeError, match="below 3"):
        distinct_total(0.1, None, [7.5, 7.0, 7.25])


def test_the_union_is_the_distinct_experts_each_step_loads_counted_from_the_routers(tiny, profile):
    """Independent count: every token's top-K candidates recorded on a full-K pass of B windows,
    the distinct ones of each position (step) counted with Python sets."""
    model, tok, text = tiny
    windows = _windows(tok, text)
    seen: dict[int, list[set]] = {}

    def record(layer, cand_idx, cand_probs, counts, valid):
        steps = cand_idx.view(B, SEQ, -1)                                  # [B, S, K]
        seen.setdefault(layer, []).extend(set(steps[:, s].reshape(-1).tolist()) for s in range(SEQ))

    with apply_plan(model, static_plan(model, [4, 4, 4])) as handle:
        handle.context.recorders.append(record)
        for batch in windows.split(B):
            model(input_ids=batch)
    for position, layer in enumerate(sorted(seen)):
        sizes = [len(step) for step in seen[layer]]
        assert profile["union_mean"][position] == pytest.approx(sum(sizes) / len(sizes))
        assert profile["union_max"][position] == max(sizes)
    assert profile["calibration"]["tokens_scored"] == windows.numel() - windows.size(0)
    assert profile["calibration"]["windows"] == TOKENS // SEQ


def test_the_profile_cells_are_plain_perplexity_runs(tiny, profile):
    model, tok, text = tiny
    windows = _windows(tok, text)
    full = _ppl(model, static_plan(model, [4, 4, 4]), windows)
    assert profile["unrestricted_perplexity"] == full
    for position, row in enumerate(profile["sensitivity"]):
        assert len(row) == 8
        top = profile["union_max"][position]
        assert row[top - 1:] == [full] * (8 - top + 1)                     # at and above the max union
        # the policy at the max union is the unrestricted model, measured, not assumed
        assert _ppl(model, _one_layer_capped(model, position, top), windows) == pytest.approx(full, rel=1e-6)
        assert profile["measured"][position] == list(range(1, top))
    # a cell from the prefix-cached run equals a full pass of the same configuration
    for position, m in [(0, 1), (1, 3), (2, 2)]:
        assert profile["sensitivity"][position][m - 1] == pytest.approx(
            _ppl(model, _one_layer_capped(model, position, m), windows), rel=1e-5)
    facts = profile["provenance"]
    assert facts["cells"] == sum(u - 1 for u in profile["union_max"])
    assert facts["prefix_cache"] and facts["layer_passes"] < facts["naive_layer_passes"]
    assert profile["sensitivity"][0][0] > full                               # one expert per step costs quality


def test_the_dp_equals_brute_force_over_every_allocation(profile):
    table = profile["sensitivity"]
    num_layers, num_experts = len(table), len(table[0])
    for total in range(num_layers, num_layers * num_experts + 1):
        ms = solve_allocation(table, total)
        assert sum(ms) <= total and all(1 <= m <= num_experts for m in ms)
        best = min(sum(table[i][m - 1] for i, m in enumerate(combo))
                   for combo in itertools.product(range(1, num_experts + 1), repeat=num_layers)
                   if sum(combo) <= total)
        assert sum(table[i][m - 1] for i, m in enumerate(ms)) == pytest.approx(best, rel=1e-12)


def test_allocation_spends_the_total_it_is_given(tiny, profile):
    model = tiny[0]
    union = sum(profile["union_mean"])
    for budget, total in [("0.5", math.floor(0.5 * union + 0.5)), ("1/3", math.floor(union / 3 + 0.5)),
                          ("3", 9), ("2.5", 8)]:
        plan = allocate_distinct(budget, profile=profile, model=model)
        ms = [p.max_experts for _, p in sorted(plan.layers.items())]
        details = plan.provenance["details"]
        assert details["total"] == total and sum(ms) <= total and sum(ms) == details["allocated"]
        assert all(1 <= m <= 8 for m in ms) and all(isinstance(p, DistinctExperts) for p in plan.layers.values())
        assert ms == solve_allocation(profile["sensitivity"], total)
    assert details["decode_batch"] == B and details["calibration"]["tokens_scored"] > 0
    # a table where every added expert helps (a random tiny model's need not) is spent in full
    falling = {**profile, "sensitivity": [[100.0 / m + i for m in range(1, 9)] for i in range(3)]}
    for budget in ("0.5", "1/3", "3", "2.5", "8"):
        plan = allocate_distinct(budget, profile=falling)
        assert sum(p.max_experts for p in plan.layers.values()) == plan.provenance["details"]["total"]


def test_a_coarser_grid_measures_fewer_cells_to_the_same_numbers(tiny, profile):
    model, tok, text = tiny
    coarse = distinct_profile(model, tok, text, {**CONFIG, "m_step": 3})
    for position, top in enumerate(coarse["union_max"]):
        assert coarse["measured"][position] == profile_grid(top, 3) == list(range(1, top, 3))
        row, fine = coarse["sensitivity"][position], profile["sensitivity"][position]
        for m in coarse["measured"][position]:
            assert row[m - 1] == pytest.approx(fine[m - 1], rel=1e-6)
        for m in range(1, top):                                            # linear between measured points
            lo = max(g for g in coarse["measured"][position] if g <= m)
            hi = min([g for g in coarse["measured"][position] if g >= m] or [top])
            assert min(row[lo - 1], row[hi - 1]) - 1e-9 <= row[m - 1] <= max(row[lo - 1], row[hi - 1]) + 1e-9
    assert coarse["provenance"]["cells"] < profile["provenance"]["cells"]


def test_an_interrupted_profile_resumes_from_its_file(tiny, profile, tmp_path, monkeypatch):
    model, tok, text = tiny
    resume = tmp_path / "plan.json.distinct.partial.json"
    real, calls = distinct_module._score, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 6:                    # the unrestricted pass, then 4 cells, then Ctrl-C
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(distinct_module, "_score", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distinct_profile(model, tok, text, CONFIG, resume_file=resume)
    assert len(json.loads(resume.read_text())["cells"]) == 4
    monkeypatch.setattr(distinct_module, "_score", real)
    resumed = distinct_profile(model, tok, text, CONFIG, resume_file=resume)
    assert resumed["provenance"]["cells_resumed"] == 4 and not resume.exists()
    assert sum(resumed["sensitivity"], []) == pytest.approx(sum(profile["sensitivity"], []), rel=1e-6)


def test_a_budget_below_one_expert_per_layer_is_refused_before_any_cell(tiny, monkeypatch):
    model, tok, text = tiny
    monkeypatch.setattr(CellRun, "cells", lambda *a: pytest.fail("a cell ran"))
    with pytest.raises(AllocMoeError, match="below 3 .one per layer.; give at least"):
        allocate_distinct("0.105", model=model, tokenizer=tok, calib_text=text, config=CONFIG)


def test_the_python_api_points_to_the_distinct_allocation(tiny, profile):
    model, tok, text = tiny
    with pytest.raises(AllocMoeError, match="allocate_distinct"):
        allocate("0.5", "distinct", model=model)
    with pytest.raises(AllocMoeError, match="not a distinct profile"):
        allocate_distinct("0.5", profile={"sensitivity": [[1.0]]})
    with pytest.raises(AllocMoeError, match="measured at decode batch 4"):
        allocate_distinct("0.5", profile=profile, config={"decode_batch": 16})
    with pytest.raises(AllocMoeError, match="needs a distinct profile, or the model"):
        allocate_distinct("0.5", model=model)


def test_cli_allocate_writes_a_plan_that_eval_measures_within_its_caps(tiny_folder, tmp_path, capsys):
    plan_path, result_path = tmp_path / "latency.json", tmp_path / "eval.json"
    main(["allocate", "--model", str(tiny_folder), "--max-distinct-experts", "0.5", "--decode-batch", str(B),
          "--seq-len", str(SEQ), "--calib-tokens", str(TOKENS), "--output", str(plan_path), "--quiet"])
    assert "at most M_l distinct experts per decode step at batch 4" in capsys.readouterr().err
    assert not (tmp_path / "latency.json.distinct.partial.json").exists()
    plan = Plan.load(plan_path)
    caps = {index: policy.max_experts for index, policy in plan.layers.items()}
    details = plan.provenance["details"]
    assert plan.method == "distinct" and details["decode_batch"] == B and sum(caps.values()) <= details["total"]
    assert details["total"] == math.floor(0.5 * sum(details["union_mean"]) + 0.5)
    main(["eval", "--model", str(tiny_folder), "--plan", str(plan_path), "--decode-batch", str(B),
          "--seq-len", str(SEQ), "--eval-tokens", "512", "--output", str(result_path), "--quiet"])
    result = json.loads(result_path.read_text())
    per_layer = result["distinct_experts_per_layer"]
    assert {int(i) for i in per_layer} == set(caps)
    for index, counted in per_layer.items():
        assert counted["max"] <= caps[int(index)] and counted["mean"] <= caps[int(index)]
    assert result["max_distinct_experts_per_step"] <= max(caps.values())
    # the same text unrestricted loads more: the plan bounds something that binds
    main(["eval", "--model", str(tiny_folder), "--decode-batch", str(B), "--seq-len", str(SEQ),
          "--eval-tokens", "512", "--output", str(result_path), "--quiet"])
    assert json.loads(result_path.read_text())["distinct_experts_per_step"] > result["distinct_experts_per_step"]
