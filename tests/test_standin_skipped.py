"""Stand-ins fitted where they stand in (calibrate/means.py `fit_skipped_standins`), against brute force:
the slots a plan skips found from the router written out by hand, each expert's stand-in a weighted
least-squares fit (torch.linalg.lstsq) on those slots, weighted by the square of their gates."""

import pytest
import torch

import allocmoe.calibrate.means as means_module
from allocmoe import AllocT, Plan, StaticTopK, apply_plan, model_fingerprint
from allocmoe.calibrate.means import fit_skipped_standins, measure_expert_means
from allocmoe.core.means import ExpertMeans
from conftest import COMMON, FAMILIES, build_tiny, expert_inputs, olmoe_expert_output

HIDDEN = COMMON["hidden_size"]


def below(plan: Plan, index: int, fitted: ExpertMeans) -> Plan:
    """The plan on the MoE layers below `index` (with `fitted`'s stand-ins there), full K from it up."""
    fp = plan.model
    return Plan(model=fp, method="by hand", budget=plan.budget,
                layers={i: plan.layers[i] if i < index else StaticTopK(fp["k_orig"]) for i in fp["moe_layers"]},
                means=fitted.restricted([i for i in fitted.means if i < index]) if index > fp["moe_layers"][0] else None)


def skipped_slots(model, windows, plan: Plan, index: int, fitted: ExpertMeans):
    """(inputs [P, H], experts [P], gates [P]) of the slots static top-k skips at layer `index`: each token's
    ranks k..K-1 by OLMoE's softmax router (no renormalisation), on the inputs the plan below produces."""
    x, _ = expert_inputs(model, windows, index, below(plan, index, fitted))
    probs = torch.softmax(x @ model.model.layers[index].mlp.gate.weight.T, dim=-1)
    gates, experts = probs.topk(plan.k_orig, dim=-1)
    k = plan.layers[index].k
    return x.repeat_interleave(plan.k_orig - k, dim=0), experts[:, k:].reshape(-1), gates[:, k:].reshape(-1)


def stand_in(means: ExpertMeans, index: int, e: int, x: torch.Tensor) -> torch.Tensor:
    term = means.linear[index]
    return means.means[index][e] + ((x - term.input_mean[e]) @ term.down[e]) @ term.up[e]


@torch.no_grad()
def test_each_expert_is_the_gate_squared_weighted_least_squares_fit_on_the_slots_the_plan_skips():
    model = build_tiny("olmoe")
    fp = model_fingerprint(model)
    windows = torch.randint(0, COMMON["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(5))
    plan = Plan(model=fp, layers={i: StaticTopK(2) for i in fp["moe_layers"]}, method="test", budget=6.0)
    plan.means = measure_expert_means(model, windows, rank=HIDDEN)          # full rank: the fit is lstsq's
    fitted = fit_skipped_standins(model, windows, plan, ridge=1e-12)
    assert sorted(fitted.means) == fp["moe_layers"] and fitted.rank == HIDDEN
    for index in fp["moe_layers"]:
        x, experts, gates = skipped_slots(model, windows, plan, index, fitted)
        module = model.model.layers[index].mlp.experts
        for e in range(fp["num_experts"]):
            rows = experts == e
            assert int(rows.sum()) >= HIDDEN                                  # enough slots: fitted here
            xe, w = x[rows].double(), gates[rows].double() ** 2
            ye = olmoe_expert_output(module, x[rows], e).double()
            design = torch.cat([torch.ones(len(xe), 1, dtype=xe.dtype), xe], 1) * w.sqrt()[:, None]
            coef = torch.linalg.lstsq(design, ye * w.sqrt()[:, None]).solution
            want = torch.cat([torch.ones(len(xe), 1, dtype=xe.dtype), xe], 1) @ coef
            torch.testing.assert_close(stand_in(fitted, index, e, x[rows]).double(), want, rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(fitted.linear[index].input_mean[e].double(),
                                       (w[:, None] * xe).sum(0) / w.sum(), rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_an_expert_skipped_on_fewer_than_h_slots_keeps_its_fit_on_every_routed_token():
    model = build_tiny("olmoe")
    fp = model_fingerprint(model)
    windows = torch.randint(0, COMMON["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(6))
    plan = Plan(model=fp, layers={i: StaticTopK(3) for i in fp["moe_layers"]}, method="test", budget=9.0)
    plan.means = measure_expert_means(model, windows, rank=2)
    fitted = fit_skipped_standins(model, windows, plan)
    kept_plain = refitted = 0
    for index in fp["moe_layers"]:
        _, experts, _ = skipped_slots(model, windows, plan, index, fitted)
        for e in range(fp["num_experts"]):
            same = all(torch.equal(getattr(fitted.linear[index], part)[e], getattr(plan.means.linear[index], part)[e])
                       for part in ("input_mean", "down", "up"))
            same = same and torch.equal(fitted.means[index][e], plan.means.means[index][e])
            few = int((experts == e).sum()) < HIDDEN
            assert same == few, (index, e, int((experts == e).sum()))
            kept_plain, refitted = kept_plain + few, refitted + (not few)
    assert kept_plain and refitted                                           # both cases were exercised


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_every_family_fits_on_as_many_slots_as_its_router_drops(family, monkeypatch):
    """The skipped slots come from the family's own scores (its adapter), Alloc-T's pool included: at each
    layer the fit sees K x tokens - the activations the plan's router counts over the same windows."""
    model = build_tiny(family)
    fp = model_fingerprint(model)
    k_orig = fp["k_orig"]
    windows = torch.randint(0, COMMON["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(8))
    layers = fp["moe_layers"]
    plan = Plan(model=fp, layers={i: StaticTopK(k_orig - 1) if n % 2 else AllocT(k=k_orig / 2, k_base=0)
                                  for n, i in enumerate(layers)}, method="test", budget=float(k_orig * len(layers)))
    plan.means = measure_expert_means(model, windows, rank=2)
    samples, real = {}, means_module._skipped_fit

    def spy(moments, plain, index, rank, ridge):
        samples[index] = float(moments.samples.sum())
        return real(moments, plain, index, rank, ridge)

    monkeypatch.setattr(means_module, "_skipped_fit", spy)
    shipped = Plan(**{**plan.__dict__, "means": fit_skipped_standins(model, windows, plan, batch_size=4)})
    with apply_plan(model, shipped) as handle:
        for batch in windows.split(4):
            model(batch)
        activations = handle.layer_activations()
    for index in layers:
        assert samples[index] == pytest.approx((k_orig - activations[index]) * windows.numel()), index
        assert 0 < samples[index] < k_orig * windows.numel()
