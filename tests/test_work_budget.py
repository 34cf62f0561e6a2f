"""One budget for all the work: a plan's cost is its activations plus its stand-ins in activation-
equivalents (core/budget.py), checked against hand counts and against the work the code does."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from allocmoe.core.budget import layer_cost, standin_equivalent
from allocmoe.core.means import ExpertMeans, LinearTerm
from allocmoe.routing.adapters import adapter_for_model
from allocmoe.routing.layout import expert_weights, standin_costs
from allocmoe.routing.substitute import LayerSubstitute
from conftest import build_tiny

H, I, E = 32, 16, 8          # the tiny deepseek_v2 model: hidden 32, expert width 16, 8 routed experts


def matmul_multiply_adds(fn) -> int:
    """Multiply-adds of the matrix products `fn` runs, as torch's own counter sees them (2 flops each)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2


def test_an_experts_weight_work_is_3_h_i_as_counted_by_hand_and_by_torch():
    model = build_tiny("deepseek_v2")
    assert expert_weights(model) == 3 * H * I                      # gate, up, down: H x I each
    experts = adapter_for_model(model).moe_layers(model)[0].experts
    x = torch.randn(1, H)

    def one_expert():
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[0]).chunk(2, dim=-1)
        torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[0])
    assert matmul_multiply_adds(one_expert) == expert_weights(model)


@pytest.mark.parametrize("rank", [0, 1, 8])
def test_a_standins_cost_is_its_multiply_adds_over_an_experts(rank):
    model = build_tiny("deepseek_v2")
    # hand count per skipped slot: 2 H r for the rank-r term, H for gate x stand-in; an expert 3 H I + H
    hand = (2 * H * rank + H) / (3 * H * I + H)
    assert standin_equivalent(H, expert_weights(model), rank) == pytest.approx(hand, rel=1e-12)
    if rank:
        # the stand-in's own products, as the code runs them for one (token, skipped expert) pair
        sub = LayerSubstitute(offset=torch.randn(E, H), down=torch.randn(E, H, rank), up=torch.randn(E, rank, H))
        counted = matmul_multiply_adds(lambda: sub._pairs(torch.tensor([0]), torch.tensor([3]), torch.ones(1),
                                                          torch.randn(1, H)))
        assert counted == 2 * H * rank
    means = ExpertMeans(means={1: torch.zeros(E, H), 2: torch.zeros(E, H)}, tokens=10,
                        linear={1: LinearTerm(torch.zeros(E, H), torch.zeros(E, H, rank), torch.zeros(E, rank, H))})
    costs = standin_costs(model, means)
    assert costs[1] == pytest.approx(hand) and costs[2] == pytest.approx(H / (3 * H * I + H))   # layer 2: means alone


def test_the_issues_numbers():
    """The built-in model (H 128, I 64) pays 8.8% of an expert per rank-8 stand-in; DeepSeek-V2-Lite
    (H 2048, I 1408) 0.4%: a half-budget plan of the built-in model's 36 slots with stand-ins on the
    18 skipped costs 18 + 18 x 0.088 = 19.6 activations."""
    builtin = standin_equivalent(128, 3 * 128 * 64, 8)
    assert builtin == pytest.approx(17 / 193)
    assert standin_equivalent(2048, 3 * 2048 * 1408, 8) == pytest.approx(17 / (3 * 1408 + 1))
    assert sum(layer_cost(3, 6, builtin) for _ in range(6)) == pytest.approx(18 + 18 * 17 / 193)
    assert layer_cost(3, 6, None) == 3


TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(400))
CFG = {"seq_len": 32, "calib_tokens": 256, "windows_per_pass": 4, "progress": False}


@pytest.fixture(scope="module")
def qwen(tok):
    return build_tiny("qwen3_moe", vocab_size=len(tok)), tok


@pytest.mark.parametrize("method", ["uniform", "alloc-t", "descending"])
def test_a_substitute_plan_pays_its_standins_from_the_budget(qwen, method, tmp_path):
    """Hand count: qwen3_moe tiny (3 MoE layers, K 4, H 32, I 16), rank 2: u = (2*32*2 + 32) / (3*32*16 + 32)
    = 160 / 1568 per skipped slot; at B = 6 the activations a may spend satisfy a + (12 - a) u <= 6."""
    from allocmoe import Plan, allocate

    model, tok = qwen
    u = 160 / 1568
    plan = allocate("0.5", method, model=model, tokenizer=tok, calib_text=TEXT,
                    config={**CFG, "substitute": True, "substitute_rank": 2})
    ks = {i: p.k for i, p in plan.layers.items()}
    cost = plan.cost()
    for index, k in ks.items():
        assert cost["layers"][index] == pytest.approx(k + (4 - k) * u)
    activations = sum(ks.values())
    assert cost["total"] == pytest.approx(activations + (12 - activations) * u)
    assert cost["total"] <= 6 + 1e-9 and plan.budget == 6
    most = (6 - 12 * u) / (1 - u)                   # 5.5: the activations the stand-ins leave
    assert activations <= most + 1e-9 and activations > most - (1 if method != "alloc-t" else 1e-6)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.cost()["total"] == pytest.approx(cost["total"]) and loaded.standins == pytest.approx(plan.standins)
    import dataclasses                                # the same plan with its means taken off (bench's twin)
    assert dataclasses.replace(loaded, means=None, substitute=None).cost()["total"] == pytest.approx(activations)
    with allocmoe_apply(model, loaded) as handle:
        windows = torch.randint(0, len(tok), (2, 32))
        model(windows)
        measured = loaded.measured_cost(handle.layer_activations())
    # alloc-t rounds a fractional pool down per pass (T x (k - k_base) activations): never above the stated cost
    assert cost["total"] - 0.05 <= measured <= cost["total"] + 1e-9


def allocmoe_apply(model, plan):
    from allocmoe import apply_plan

    return apply_plan(model, plan)


def test_a_budget_too_small_for_one_expert_and_its_standins_is_refused_in_one_line(qwen):
    from allocmoe import AllocMoeError, allocate

    model, tok = qwen
    with pytest.raises(AllocMoeError, match="cannot hold the substitute"):
        allocate("3", "uniform", model=model, tokenizer=tok, calib_text=TEXT,
                 config={**CFG, "substitute": True, "substitute_rank": 2})


def test_a_plan_file_whose_cost_passes_its_budget_is_refused(qwen, tmp_path):
    import json

    from allocmoe import AllocMoeError, Plan, allocate

    model, tok = qwen
    plan = allocate("0.5", "uniform", model=model, tokenizer=tok, calib_text=TEXT,
                    config={**CFG, "substitute": True, "substitute_rank": 2})
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    data["budget"].update({"activations_per_token": 5.0, "fraction": 5 / 12})
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(AllocMoeError, match="cost.total .* is above budget"):
        Plan.load(tmp_path / "p.json")
    del data["cost"]                                  # an older plan: loads, its stand-ins' cost not known
    data["budget"].update({"activations_per_token": 6.0, "fraction": 0.5})
    (tmp_path / "p.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "p.json")
    assert old.cost() is None and "not recorded" in old.cost_text()
    from allocmoe.routing.layout import check_plan

    check_plan(old, model)                            # a model at hand fills it in
    assert old.cost()["total"] == pytest.approx(plan.cost()["total"])


# -- the (k, stand-in) DP against brute force ----------------------------------------------------------

def brute_force_menu(losses, costs, budget):
    """The least summed loss over every choice of one option per layer whose summed cost fits."""
    import itertools

    best = None
    for choice in itertools.product(*[range(len(row)) for row in losses]):
        cost = sum(costs[i][j] for i, j in enumerate(choice))
        if cost <= budget + 1e-9:
            loss = sum(losses[i][j] for i, j in enumerate(choice))
            best = loss if best is None else min(best, loss)
    return best


def pair_menu(rng, num_layers, k_orig, u):
    """Random (k, stand-in) menus: options k = 1..K without, then k = 1..K with a stand-in of cost u per
    skipped slot; losses fall with k, and a stand-in helps by a random amount (or hurts a little)."""
    losses, costs = [], []
    for _ in range(num_layers):
        plain = sorted((rng.random() * 10 for _ in range(k_orig)), reverse=True)
        helped = [p - rng.uniform(-0.5, 2.0) * (k_orig - k) / k_orig for k, p in enumerate(plain, 1)]
        losses.append(plain + helped)
        costs.append([float(k) for k in range(1, k_orig + 1)] + [k + (k_orig - k) * u for k in range(1, k_orig + 1)])
    return losses, costs


@pytest.mark.parametrize("seed", range(40))
def test_the_pair_dp_matches_brute_force_and_never_exceeds_the_budget(seed):
    import random

    from allocmoe.core.solver import solve_menu_allocation

    rng = random.Random(seed)
    num_layers, k_orig = rng.randint(1, 4), rng.randint(1, 4)
    u = rng.choice([0.0, 0.01, 17 / 193, 0.35, rng.random()])
    losses, costs = pair_menu(rng, num_layers, k_orig, u)
    cheapest = sum(min(row) for row in costs)
    for budget in [cheapest, rng.uniform(cheapest, num_layers * k_orig), num_layers * k_orig,
                   round(rng.uniform(cheapest, num_layers * k_orig))]:
        if budget < cheapest:
            continue
        choice = solve_menu_allocation(losses, costs, budget)
        spent = sum(costs[i][j] for i, j in enumerate(choice))
        assert spent <= budget + 1e-9
        assert sum(losses[i][j] for i, j in enumerate(choice)) == pytest.approx(
            brute_force_menu(losses, costs, budget), abs=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_the_rank_menu_choice_is_the_best_k_and_rank_per_layer_by_brute_force(seed):
    """menu_choice over a (k, rank) profile with several ranks: the summed loss of its (k, rank) per layer
    is brute force's best over every layer's (k, none) and (k, r) options, their cost (k, plus K - k
    stand-ins at rank r's price) within B; a layer at K_orig is never said to carry stand-ins."""
    import itertools
    import random

    from allocmoe.calibrate.methods import menu_choice

    rng = random.Random(300 + seed)
    num_layers, k_orig = rng.randint(1, 3), rng.randint(2, 4)
    ranks = sorted(rng.sample([0, 2, 4, 8, 16], rng.randint(1, 3)))
    layers = sorted(rng.sample(range(1, 9), num_layers))
    price = {r: {i: (2 * r + 1) / rng.uniform(20, 60) for i in layers} for r in ranks}
    plain = [sorted((rng.random() * 10 for _ in range(k_orig)), reverse=True) for _ in layers]
    table = {"plain": plain, "standin": {r: [[p - rng.uniform(-0.5, 2.0) * (k_orig - k) / k_orig
                                              for k, p in enumerate(row, 1)] for row in plain] for r in ranks}}
    options = [[(k, None, plain[i][k - 1], float(k)) for k in range(1, k_orig + 1)]
               + [(k, r, table["standin"][r][i][k - 1], k + (k_orig - k) * price[r][index])
                  for r in ranks for k in range(1, k_orig + 1)] for i, index in enumerate(layers)]
    budget = rng.uniform(num_layers, num_layers * k_orig)
    best = min(sum(o[2] for o in pick) for pick in itertools.product(*options) if sum(o[3] for o in pick) <= budget + 1e-9)
    ks, given = menu_choice(table, price, layers, k_orig, budget)
    loss = sum(table["standin"][given[index]][i][k - 1] if index in given else plain[i][k - 1]
               for i, (index, k) in enumerate(zip(layers, ks)))
    cost = sum(k + ((k_orig - k) * price[given[index]][index] if index in given else 0) for index, k in zip(layers, ks))
    assert loss == pytest.approx(best, abs=1e-9) and cost <= budget + 1e-9
    assert all(ks[layers.index(index)] < k_orig and r in ranks for index, r in given.items())


@pytest.mark.parametrize("seed", range(10))
def test_without_standins_the_pair_dp_is_alloc_ls_dp(seed):
    import random

    from allocmoe.core.solver import solve_allocation, solve_menu_allocation

    rng = random.Random(100 + seed)
    num_layers, k_orig = rng.randint(1, 6), rng.randint(1, 6)
    table = [[rng.random() for _ in range(k_orig)] for _ in range(num_layers)]
    costs = [[float(k) for k in range(1, k_orig + 1)]] * num_layers
    budget = rng.randint(num_layers, num_layers * k_orig)
    ks = solve_allocation(table, budget)
    choice = solve_menu_allocation(table, costs, budget)
    assert sum(table[i][j] for i, j in enumerate(choice)) == pytest.approx(
        sum(table[i][k - 1] for i, k in enumerate(ks)), abs=1e-12)


def test_the_pair_dp_is_fast_at_deepseek_v2_lite_size():
    import random
    import time

    from allocmoe.core.solver import solve_menu_allocation

    losses, costs = pair_menu(random.Random(0), 26, 6, 17 / (3 * 1408 + 1))
    start = time.perf_counter()
    choice = solve_menu_allocation(losses, costs, 78)
    assert time.perf_counter() - start < 5 and sum(costs[i][j] for i, j in enumerate(choice)) <= 78 + 1e-9


def test_the_pair_dp_refuses_a_budget_below_the_cheapest_menu():
    from allocmoe import AllocMoeError
    from allocmoe.core.solver import solve_menu_allocation

    with pytest.raises(AllocMoeError, match="below 2"):
        solve_menu_allocation([[1.0, 0.5], [1.0, 0.5]], [[1.0, 1.5], [1.0, 1.5]], 1.5)


# -- the (k, stand-in) profile and auto's budget ---------------------------------------------------

def test_the_pair_profile_is_each_cell_applied_by_hand(qwen):
    """Each cell, for each rank of the menu, against the plan applied by hand with stand-ins fitted by
    the test at that rank (not cut from a larger fit)."""
    from allocmoe import apply_plan, model_fingerprint, static_plan
    from allocmoe.calibrate.means import measure_expert_means
    from allocmoe.calibrate.pairs import pair_profile
    from allocmoe.scoring import evaluate_perplexity, tokenize_windows

    model, tok = qwen
    windows = tokenize_windows(tok, TEXT, 32, 256)
    top = measure_expert_means(model, windows, 4, progress=False, rank=4)
    menu = {r: top.truncated({i: r for i in top.means}) for r in (0, 2, 4)}
    table = pair_profile(model, windows, menu, 4)
    fp = model_fingerprint(model)
    L, K = fp["num_moe_layers"], fp["k_orig"]
    for r in (0, 2, 4):
        means = measure_expert_means(model, windows, 4, progress=False, rank=r)
        for i, index in enumerate(fp["moe_layers"]):
            for k in range(1, K + 1):
                plan = static_plan(model, [K] * i + [k] + [1] * (L - i - 1))
                with apply_plan(model, plan):
                    plain = evaluate_perplexity(model, None, "", {"progress": False}, windows=windows).perplexity
                plan.means = means.restricted([index])
                with apply_plan(model, plan):
                    standin = evaluate_perplexity(model, None, "", {"progress": False}, windows=windows).perplexity
                assert table["plain"][i][k - 1] == pytest.approx(plain, rel=1e-9)
                assert table["standin"][r][i][k - 1] == pytest.approx(standin, rel=1e-6)
    assert table["cells"] == (L * K - (L - 1)) + 3 * L * (K - 1)
    assert pair_profile(model, windows, menu, 4) is table              # memoised for the next budget


def hand_cost(plan, k_orig=4):
    """A plan's activations plus its stand-ins, counted from its own k and means: on the tiny qwen (H 32,
    experts 3 x 32 x 16 + 32 = 1568 multiply-adds) a rank-r stand-in costs (2 x 32 x r + 32) / 1568."""
    ranks = plan.means.ranks if plan.means is not None else {}
    return sum(p.k + ((k_orig - p.k) * (64 * ranks[i] + 32) / 1568 if i in ranks else 0)
               for i, p in plan.layers.items())


@pytest.mark.parametrize("budget", ["0.5", "7", "0.75", "11"])
def test_auto_never_spends_past_the_budget_in_total(qwen, budget, monkeypatch):
    """Every plan auto scores (its trials, every refinement step) and the plan it keeps cost at most B in
    activations plus stand-ins, counted by hand from each plan's own k and means."""
    from allocmoe import allocate
    from allocmoe.calibrate import methods
    from allocmoe.calibrate.profile import profile_sensitivity
    from allocmoe.core.budget import Budget

    model, tok = qwen
    profile = profile_sensitivity(model, tok, TEXT, {"seq_len": 32, "calib_tokens": 256, "progress": False})
    scored, calib_ppl = [], methods._calib_ppl
    monkeypatch.setattr(methods, "_calib_ppl", lambda m, p, w, c: (scored.append(hand_cost(p)), calib_ppl(m, p, w, c))[1])
    plan = allocate(budget, "auto", profile=profile, model=model, tokenizer=tok, calib_text=TEXT,
                    config={**CFG, "substitute_rank": 2, "refine": 6})
    B = Budget.parse(budget, 3, 4).activations_per_token
    spent = hand_cost(plan)
    assert spent <= B + 1e-9 and plan.cost()["total"] == pytest.approx(spent)
    assert len(scored) > 10 and max(scored) <= B + 1e-9
    trials = plan.provenance["details"]["trials"]
    assert any(t.get("menu") for t in trials) and len(trials) > 1
    # the default menu: stand-ins at substitute_rank or none (rank_menu off)
    assert {t["menu"] for t in trials if t.get("menu")} == {"k x stand-in"}
    assert all(set(t["standin_ranks"].values()) <= {2} for t in trials if t.get("menu"))
    assert plan.provenance["details"]["refine"]["start_calibration_perplexity"] == pytest.approx(
        min(t["calibration_perplexity"] for t in trials))


def test_a_perplexity_target_with_standins_searches_only_budgets_that_hold_them(qwen):
    """Rank 8 on the tiny qwen: u = (2*32*8 + 32) / 1568, so one expert per layer plus its stand-ins costs
    3 (1 + 3u) = 6.12: the search starts at 7, and the plan it returns fits the budget it found."""
    from allocmoe import allocate

    model, tok = qwen
    u = 544 / 1568
    plan = allocate(method="uniform", model=model, tokenizer=tok, calib_text=TEXT, target_ppl="1000%",
                    config={**CFG, "substitute": True})
    tried = [int(b) for b in plan.provenance["target"]["tried"]]
    assert min(tried) == math.ceil(3 * (1 + 3 * u)) == 7
    assert plan.cost()["total"] <= plan.budget + 1e-9


def test_the_sweep_table_shows_each_rows_stand_ins_and_total():
    from allocmoe.measure.report import markdown_table

    base = {"budget": 0.5, "budget_activations": 18.0, "relative_change": 0.02}
    results = {"model": {"model_type": "deepseek_v2", "num_moe_layers": 6, "num_experts": 32, "k_orig": 6},
               "full": {"perplexity": 148.0, "activations_per_token": 36.0},
               "evaluation": {"text": "t", "tokens": 10, "seq_len": 5, "batch_size": 1},
               "rows": [{**base, "method": "auto", "perplexity": 150.0, "activations_per_token": 16.0,
                         "cost_per_token": 16.0 + 20 * 17 / 193},
                        {**base, "method": "uniform", "perplexity": 170.0, "activations_per_token": 18.0,
                         "cost_per_token": 18.0},
                        {**base, "method": "top-p", "perplexity": 171.0, "activations_per_token": 18.3}]}
    table = markdown_table(results)
    assert f"[16.00 + {20 * 17 / 193:.2f} = {16 + 20 * 17 / 193:.2f}]" in table
    assert "[18.00]" in table and "[18.30]" in table


def test_on_deepseek_v2_lites_shape_a_standin_is_04_percent_of_an_expert():
    """Read off the real architecture (on the meta device, no weights): 3 x 2048 x 1408 per expert; a
    rank-8 stand-in costs (2*2048*8 + 2048) / (3*2048*1408 + 2048) = 0.40% of one, so half of the
    paper's budget (78 of 156) leaves 77.68 activations for the experts."""
    from transformers import AutoModelForCausalLM

    from allocmoe.core.budget import Budget, expert_budget
    from allocmoe.measure.synthetic import synthetic_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(synthetic_config("deepseek-v2-lite", 3))
    assert expert_weights(model) == 3 * 2048 * 1408
    u = standin_equivalent(2048, expert_weights(model), 8)
    assert u == pytest.approx(17 / 4225) and 0.0040 < u < 0.0041
    left = expert_budget(Budget(78.0, 156, 26), u, 6).activations_per_token
    assert left == pytest.approx((78 - 156 * u) / (1 - u), abs=1e-8) and 77.68 < left < 77.69
