"""The substitute: skipped experts' calibrated means added back, on tiny models of every family."""

import json

import pytest
import torch

from allocmoe import AllocMoeError, AllocT, Plan, StaticTopK, apply_plan, distinct_plan, model_fingerprint, static_plan
from allocmoe.calibrate.means import measure_expert_means
from allocmoe.core.means import ExpertMeans, LinearTerm
from allocmoe.routing.apply import apply_plans
from allocmoe.routing.layout import load_plan
from conftest import COMMON, build_tiny


def plan_of(model, policy):
    fp = model_fingerprint(model)
    return Plan(model=fp, layers={i: policy for i in fp["moe_layers"]}, method="test",
                budget=float(policy.k * fp["num_moe_layers"]))


def random_means(model, seed=0, rank=0):
    """Random stand-ins: means, and with `rank` a linear term of that rank."""
    fp = model_fingerprint(model)
    gen = torch.Generator().manual_seed(seed)
    num_experts, hidden = fp["num_experts"], model.config.hidden_size
    linear = {i: LinearTerm(torch.randn(num_experts, hidden, generator=gen),
                            torch.randn(num_experts, hidden, rank, generator=gen) / 4,
                            torch.randn(num_experts, rank, hidden, generator=gen) / 4)
              for i in fp["moe_layers"]} if rank else None
    return ExpertMeans({i: torch.randn(num_experts, hidden, generator=gen) for i in fp["moe_layers"]}, tokens=10,
                       linear=linear)


@torch.no_grad()
def test_at_full_k_the_substitute_changes_nothing_bit_for_bit(family_model, ids):
    _, model = family_model
    k_orig = model_fingerprint(model)["k_orig"]
    for policy in (StaticTopK(k_orig), AllocT(k_orig, k_base=1)):
        with apply_plan(model, plan_of(model, policy)):
            plain = model(ids).logits
        with_means = plan_of(model, policy)
        with_means.means = random_means(model, rank=3)   # large, random: anything added would show
        with apply_plan(model, with_means):
            substituted = model(ids).logits
        assert torch.equal(substituted, plain)
    assert (plain - model(ids).logits).abs().max() <= 1e-5       # and the plan is the unmodified model


@torch.no_grad()
def test_with_means_of_the_very_token_it_reproduces_the_full_model_at_any_budget(family_model):
    """For one token, each expert's calibrated mean over that token is its exact output, so adding
    gate x mean for every skipped candidate must give back the full model, weights included (the
    renormalising families check that kept experts keep their full-K weights)."""
    _, model = family_model
    token = torch.tensor([[7]])
    full = model(token).logits
    means = measure_expert_means(model, token)
    for k in range(1, model_fingerprint(model)["k_orig"]):
        cut = plan_of(model, StaticTopK(k))
        with apply_plan(model, cut):
            without = model(token).logits
        cut.means = means
        with apply_plan(model, cut):
            got = model(token).logits
        cut_error, error = (without - full).abs().max(), (got - full).abs().max()
        assert error <= 1e-5 and error < cut_error / 20              # the cut alone changes the output



@torch.no_grad()
def test_measured_means_are_each_experts_average_output_over_its_routed_tokens():
    model = build_tiny("olmoe")
    windows = torch.randint(0, COMMON["vocab_size"], (3, 10), generator=torch.Generator().manual_seed(3))
    seen = {}
    layer = model.model.layers[1].mlp
    hook = layer.experts.register_forward_pre_hook(lambda m, args: seen.update(h=args[0], idx=args[1]))
    model(windows)
    hook.remove()
    h, idx = seen["h"], seen["idx"]                                  # [T, H], [T, K]: the native top-K
    means = measure_expert_means(model, windows, batch_size=3).means[1]
    for e in range(model.config.num_experts):
        rows = (idx == e).any(-1)
        if not rows.any():
            assert torch.equal(means[e], torch.zeros_like(means[e]))
            continue
        ex = layer.experts                                           # OLMoE's layout: gate_up [E, 2I, H], down [E, H, I]
        gate, up = torch.nn.functional.linear(h[rows], ex.gate_up_proj[e]).chunk(2, dim=-1)
        out = torch.nn.functional.linear(ex.act_fn(gate) * up, ex.down_proj[e])
        torch.testing.assert_close(means[e], out.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", [0, 3])
@torch.no_grad()
def test_rows_of_mixed_plans_each_route_as_their_own_plan_alone(rank):
    model = build_tiny("qwen3_moe")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(5))
    with_sub, without = plan_of(model, StaticTopK(2)), plan_of(model, StaticTopK(2))
    with_sub.means = random_means(model, rank=rank)
    alone = {}
    for name, plan in (("sub", with_sub), ("plain", without)):
        with apply_plan(model, plan):
            alone[name] = model(ids).logits
    with apply_plans(model, [without, with_sub]) as handle:
        handle.context.row_plans = [1, 0]
        mixed = model(ids).logits
    torch.testing.assert_close(mixed[0], alone["sub"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], alone["plain"][1], rtol=1e-5, atol=1e-5)
    assert (alone["sub"] - alone["plain"]).abs().max() > 1e-2


def test_the_means_file_travels_with_the_plan_and_is_checked(tmp_path):
    model = build_tiny("olmoe")
    plan = plan_of(model, StaticTopK(2))
    plan.means = random_means(model)
    plan.save(tmp_path / "half.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half.json", "half.means.safetensors"]
    doc = json.loads((tmp_path / "half.json").read_text())
    assert doc["substitute"]["means_file"] == "half.means.safetensors" and doc["substitute"]["tokens"] == 10
    loaded = load_plan(tmp_path / "half.json", model)
    for index, t in plan.means.means.items():
        assert torch.equal(loaded.means.means[index], t)

    sidecar = tmp_path / "half.means.safetensors"
    data = sidecar.read_bytes()
    sidecar.write_bytes(data[:-4] + b"\x00\x00\x00\x00")            # same size, other numbers
    with pytest.raises(AllocMoeError, match="does not match the hash"):
        Plan.load(tmp_path / "half.json")
    sidecar.unlink()
    with pytest.raises(AllocMoeError, match="means file not found"):
        Plan.load(tmp_path / "half.json")

    with pytest.raises(AllocMoeError, match="were not loaded"):    # a document alone has no means
        apply_plan(model, Plan.from_dict(doc))
    doc["substitute"]["means_file"] = "../elsewhere.means.safetensors"
    with pytest.raises(AllocMoeError, match="substitute.means_file"):
        Plan.from_dict(doc)


def test_a_plan_that_fails_to_write_leaves_the_earlier_plan_and_its_means_as_they_were(tmp_path, monkeypatch):
    """Saving over a plan with means: the means file is staged, the plan written, then the means
    renamed in; a failed plan write (here an interrupt inside it) must not touch the earlier pair."""
    import allocmoe.core.plan as plan_module

    model = build_tiny("olmoe")
    old = plan_of(model, StaticTopK(2))
    old.means = random_means(model, seed=0)
    old.save(tmp_path / "half.json")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = plan_of(model, StaticTopK(3))
    new.means = random_means(model, seed=1)

    def interrupted(path, obj):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_module, "atomic_write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        new.save(tmp_path / "half.json")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before      # no temporary file left either
    loaded = load_plan(tmp_path / "half.json", model)
    for index, t in old.means.means.items():
        assert torch.equal(loaded.means.means[index], t)


def test_means_for_another_shape_are_refused(tmp_path):
    model = build_tiny("olmoe")
    plan = plan_of(model, StaticTopK(2))
    plan.means = random_means(build_tiny("olmoe", hidden_size=48))
    plan.save(tmp_path / "p.json")
    with pytest.raises(AllocMoeError, match=r"shape \(8, 48\), the model needs \(8, 32\)"):
        load_plan(tmp_path / "p.json", model)


def test_a_distinct_plan_cannot_carry_means():
    model = build_tiny("olmoe")
    plan = distinct_plan(model, 3)
    plan.means = random_means(model)
    with pytest.raises(AllocMoeError, match="distinct-expert plan cannot carry a substitute"):
        apply_plan(model, plan)
    assert "forward" not in model.model.layers[0].mlp.gate.__dict__      # nothing was installed


def test_export_takes_a_plan_with_means_to_vllm_only(tmp_path):
    from allocmoe.integrations.export import export_plan
    from allocmoe.integrations.vllm_plugin import _check_plan

    model = build_tiny("olmoe")
    plan = static_plan(model, [2, 2, 2])
    plan.means = random_means(model)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    for fmt in ("vllm-global", "sglang", "llama.cpp"):      # one engine-wide k cannot add stand-ins
        with pytest.raises(AllocMoeError, match="calibrated means.*--format vllm") as exc:
            export_plan(fmt, {None: tmp_path / "p.json"}, arch="x")
        assert "\n" not in str(exc.value)
    exported = export_plan("vllm", {None: tmp_path / "p.json"})
    assert exported.env["ALLOCMOE_PLAN"] == str((tmp_path / "p.json").resolve())
    assert any("p.means.safetensors" in n for n in exported.notes)       # the means file must travel with it
    _check_plan(loaded, model.config, None)                   # the plugin runs it


@torch.no_grad()
def test_a_replaced_plan_routes_its_rows_as_the_new_plan_alone_means_included():
    """PlanHandle.replace_plan (the server's evicted budget plans): the slot routes as the new plan, its
    stand-ins included, the other slot is untouched, and a bad index or plan is refused."""
    model = build_tiny("qwen3_moe")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(6))
    first, kept, new = plan_of(model, StaticTopK(3)), plan_of(model, StaticTopK(1)), plan_of(model, StaticTopK(2))
    new.means = random_means(model, rank=3)
    alone = {}
    for name, plan in (("kept", kept), ("new", new)):
        with apply_plan(model, plan):
            alone[name] = model(ids).logits
    with apply_plans(model, [kept, first]) as handle:
        handle.replace_plan(1, new)
        handle.context.row_plans = [1, 0]
        mixed = model(ids).logits
        assert handle.plans[1] is new
        with pytest.raises(AllocMoeError, match="index must be one of"):
            handle.replace_plan(2, new)
        with pytest.raises(AllocMoeError, match="replace_plan: plan must be a Plan"):
            handle.replace_plan(0, None)
    torch.testing.assert_close(mixed[0], alone["new"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], alone["kept"][1], rtol=1e-5, atol=1e-5)
