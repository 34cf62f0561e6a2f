"""Sequential calibration of the stand-ins (calibrate/means.py `refit_expert_means`), against a loop
written out by hand: apply the plan to the MoE layers below, record what layer l's experts receive,
and fit each expert on its routed tokens there."""

import pytest
import torch

from allocmoe import AllocMoeError, AllocT, Plan, StaticTopK, apply_plan, model_fingerprint
from allocmoe.calibrate.means import _linear, measure_expert_means, refit_expert_means
from allocmoe.core.regression import Moments
from allocmoe.core.means import ExpertMeans
from conftest import COMMON, build_tiny, expert_inputs, olmoe_expert_output


def by_hand(model, windows, plan, rank):
    """The sequential fit as a plain loop, bottom-up."""
    fp = model_fingerprint(model)
    fitted = {}
    for index in fp["moe_layers"]:
        below = Plan(model=fp, method="by hand", budget=plan.budget,
                     layers={i: plan.layers[i] if i < index else StaticTopK(fp["k_orig"]) for i in fp["moe_layers"]},
                     means=ExpertMeans({i: m for i, (m, _) in fitted.items()}, tokens=1,
                                       linear={i: t for i, (_, t) in fitted.items()}) if fitted else None)
        x, idx = expert_inputs(model, windows, index, below)
        experts = model.model.layers[index].mlp.experts
        moments = Moments(COMMON["hidden_size"], COMMON["hidden_size"], fp["num_experts"])   # the plain fit's sums
        for e in range(fp["num_experts"]):
            rows = (idx == e).any(-1)
            y = olmoe_expert_output(experts, x[rows], e)
            moments.add(x[rows].double(), y.double(), torch.full((int(rows.sum()),), e))
        fitted[index] = (moments.means()[1].float(), _linear(moments, rank))
    return fitted


@pytest.mark.parametrize("policy", [StaticTopK(1), AllocT(k=1.5, k_base=0)])
@torch.no_grad()
def test_the_sequential_fit_is_the_plain_fit_on_the_inputs_the_cut_layers_below_produce(policy):
    model = build_tiny("olmoe")
    fp = model_fingerprint(model)
    windows = torch.randint(0, COMMON["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(4))
    plan = Plan(model=fp, layers={i: policy for i in fp["moe_layers"]}, method="test", budget=4.5)
    plan.means = measure_expert_means(model, windows, rank=3)
    refit = refit_expert_means(model, windows, plan)
    expected = by_hand(model, windows, plan, 3)
    assert sorted(refit.means) == fp["moe_layers"] and refit.rank == 3 and refit.tokens == windows.numel()
    for index, (means, term) in expected.items():
        torch.testing.assert_close(refit.means[index], means, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(refit.linear[index].down @ refit.linear[index].up, term.down @ term.up,
                                   rtol=1e-3, atol=1e-4)
    first, last = fp["moe_layers"][0], fp["moe_layers"][-1]
    assert torch.equal(refit.means[first], plan.means.means[first])           # nothing is cut below the first
    assert not torch.allclose(refit.means[last], plan.means.means[last])      # above it the inputs moved


@torch.no_grad()
def test_only_the_layers_with_stand_ins_are_refitted_at_the_plans_rank_or_the_one_given():
    model = build_tiny("olmoe")
    fp = model_fingerprint(model)
    windows = torch.randint(0, COMMON["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(2))
    plan = Plan(model=fp, layers={i: StaticTopK(1) for i in fp["moe_layers"]}, method="test", budget=3.0)
    plan.means = measure_expert_means(model, windows, rank=2).restricted(fp["moe_layers"][1:])
    refit = refit_expert_means(model, windows, plan)
    assert sorted(refit.means) == fp["moe_layers"][1:] and sorted(refit.linear) == fp["moe_layers"][1:]
    assert refit_expert_means(model, windows, plan, rank=0).linear is None
    plan.means = None
    with pytest.raises(AllocMoeError, match="no stand-ins to refit"):
        refit_expert_means(model, windows, plan)


@torch.no_grad()
def test_the_fit_is_chosen_on_the_held_out_half_and_then_made_on_all_windows():
    """By hand: both fits on the even windows, perplexity of each on the odd ones (crossfit's split), the
    winner refitted on all."""
    from allocmoe.calibrate.means import choose_standin_fit
    from allocmoe.scoring.perplexity import evaluate_perplexity

    model = build_tiny("olmoe")
    fp = model_fingerprint(model)
    windows = torch.randint(0, COMMON["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(6))
    plan = Plan(model=fp, layers={i: AllocT(k=1.5, k_base=0) for i in fp["moe_layers"]}, method="test", budget=4.5)
    plan.means = measure_expert_means(model, windows, rank=2)
    means, record = choose_standin_fit(model, windows, plan)
    first, second = windows[0::2], windows[1::2]
    fits = {"plain": measure_expert_means(model, first, rank=2)}
    fits["sequential"] = refit_expert_means(model, first, Plan(**{**plan.__dict__, "means": fits["plain"]}))
    held_out = {}
    for name, fitted in fits.items():
        with apply_plan(model, Plan(**{**plan.__dict__, "means": fitted})):
            held_out[name] = evaluate_perplexity(model, None, "", {"progress": False}, windows=second).perplexity
    assert record["held_out"] == pytest.approx(held_out, rel=1e-6)
    assert record["chose"] == min(held_out, key=held_out.get)
    want = refit_expert_means(model, windows, plan) if record["chose"] == "sequential" else plan.means
    for index in fp["moe_layers"]:
        torch.testing.assert_close(means.means[index], want.means[index])
        torch.testing.assert_close(means.linear[index].down @ means.linear[index].up,
                                   want.linear[index].down @ want.linear[index].up)
    with pytest.raises(AllocMoeError, match="at least 2 windows"):
        choose_standin_fit(model, windows[:1], plan)
    plan.means = None
    with pytest.raises(AllocMoeError, match="needs a plan with stand-ins"):
        choose_standin_fit(model, windows, plan)
