"""The substitute's rank-r linear term: fitted as reduced-rank ridge regression, added back as written."""

import hashlib
import json

import pytest
import torch

from allocmoe import AllocMoeError, Plan, StaticTopK, apply_plan, model_fingerprint
from allocmoe.calibrate.means import RIDGE, measure_expert_means
from allocmoe.cli import main
from allocmoe.core.means import ExpertMeans, LinearTerm, read_means
from allocmoe.routing.layout import load_plan
from allocmoe.routing.substitute import LayerSubstitute
from conftest import COMMON, build_tiny, expert_inputs, olmoe_expert_output


def plan_of(model, k):
    fp = model_fingerprint(model)
    return Plan(model=fp, layers={i: StaticTopK(k) for i in fp["moe_layers"]}, method="test",
                budget=float(k * fp["num_moe_layers"]))


@pytest.mark.parametrize("rank", [3, COMMON["hidden_size"]])
@torch.no_grad()
def test_the_linear_term_is_the_reduced_rank_ridge_fit_of_each_experts_routed_tokens(rank):
    """Brute force on the recorded (input, output) pairs: at full rank down @ up is the ridge solution
    of the augmented least-squares system; at rank r, the fitted outputs are the best rank-r
    approximation (SVD) of the full-rank fitted outputs."""
    model = build_tiny("olmoe")
    windows = torch.randint(0, COMMON["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(4))
    hidden = COMMON["hidden_size"]
    fitted = measure_expert_means(model, windows, batch_size=4, rank=rank)
    assert fitted.rank == rank
    h, idx = expert_inputs(model, windows, 1)
    term, experts = fitted.linear[1], model.model.layers[1].mlp.experts
    checked = 0
    for e in range(model.config.num_experts):
        rows = (idx == e).any(-1)
        x, y = h[rows].double(), olmoe_expert_output(experts, h[rows], e).double()
        if rows.sum() < hidden:                                        # too few tokens: the mean alone
            assert torch.equal(term.down[e], torch.zeros_like(term.down[e]))
            continue
        xc, yc = x - x.mean(0), y - y.mean(0)
        torch.testing.assert_close(term.input_mean[e].double(), x.mean(0), rtol=1e-5, atol=1e-6)
        ridge = RIDGE * float((xc ** 2).sum(0).mean())                 # relative to the mean input variance, x n
        augmented = torch.cat([xc, ridge ** 0.5 * torch.eye(hidden, dtype=torch.float64)])
        target = torch.cat([yc, torch.zeros(hidden, hidden, dtype=torch.float64)])
        b = torch.linalg.lstsq(augmented, target).solution                      # [H, H]
        got = xc @ term.down[e].double() @ term.up[e].double()                  # [n, H]
        if rank == hidden:
            torch.testing.assert_close(term.down[e].double() @ term.up[e].double(), b, rtol=1e-3, atol=1e-4)
        u, s, vh = torch.linalg.svd(xc @ b, full_matrices=False)
        best = u[:, :rank] * s[:rank] @ vh[:rank]
        torch.testing.assert_close(got, best, rtol=1e-3, atol=1e-4)
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("gathered", [LayerSubstitute.GATHER_MAX_ELEMENTS, 0])   # decode's path, prefill's
@torch.no_grad()
def test_a_plan_adds_back_mean_plus_linear_term_for_each_skipped_candidate(gathered, monkeypatch):
    """OLMoE does not renormalise, so the kept experts' weights are the router's own; what the plan's
    layer outputs beyond the cut plan is, by hand, sum over skipped e of p_e (mean_e + (x - xbar_e) D_e U_e)."""
    monkeypatch.setattr(LayerSubstitute, "GATHER_MAX_ELEMENTS", gathered)
    model = build_tiny("olmoe")
    fp = model_fingerprint(model)
    gen = torch.Generator().manual_seed(1)
    num_experts, hidden, rank = fp["num_experts"], COMMON["hidden_size"], 4
    means = ExpertMeans({i: torch.randn(num_experts, hidden, generator=gen) for i in fp["moe_layers"]}, tokens=5,
                        linear={i: LinearTerm(torch.randn(num_experts, hidden, generator=gen),
                                              torch.randn(num_experts, hidden, rank, generator=gen) / 4,
                                              torch.randn(num_experts, rank, hidden, generator=gen) / 4)
                                for i in fp["moe_layers"]})
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=gen)
    block = model.model.layers[1].mlp
    seen = {}
    hook = block.register_forward_hook(lambda m, args, out: seen.setdefault("io", []).append((args[0], out)))
    cut, with_sub = plan_of(model, 1), plan_of(model, 1)
    with_sub.means = means
    for plan in (cut, with_sub):
        with apply_plan(model, plan):
            model(ids)
    hook.remove()
    _, (x_sub, out_sub) = seen["io"]                                 # the substituted pass's layer 1
    x = x_sub.reshape(-1, hidden)
    probs = torch.softmax(x @ block.gate.weight.T, -1)
    top_p, top_e = probs.topk(fp["k_orig"], dim=-1)
    with apply_plan(model, cut):
        plain = block(x_sub)                                           # the cut plan on the same inputs
    term = means.linear[1]
    expected = plain.reshape(-1, hidden).clone()
    for t in range(x.size(0)):
        for slot in range(1, fp["k_orig"]):
            e = int(top_e[t, slot])
            stand_in = means.means[1][e] + (x[t] - term.input_mean[e]) @ term.down[e] @ term.up[e]
            expected[t] += top_p[t, slot] * stand_in
    torch.testing.assert_close(out_sub.reshape(-1, hidden), expected, rtol=1e-4, atol=1e-4)


def test_gathered_grouped_and_dense_paths_agree_with_a_hand_sum():
    gen = torch.Generator().manual_seed(2)
    sub = LayerSubstitute(torch.randn(6, 10, generator=gen), torch.randn(6, 10, 3, generator=gen),
                          torch.randn(6, 3, 10, generator=gen))
    weights = torch.rand(5, 2, generator=gen)
    index = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(5)])
    hidden = torch.randn(5, 10, generator=gen)
    gathered = sub.skipped(weights, index, hidden)
    dense = sub.dense(torch.zeros(5, 6).scatter_(1, index, weights), hidden)
    sub.GATHER_MAX_ELEMENTS = 0                                      # prefill's path: pairs grouped by expert
    grouped = sub.skipped(weights, index, hidden)
    by_hand = torch.stack([sum(weights[t, s] * (sub.offset[index[t, s]] + hidden[t] @ sub.down[index[t, s]]
                                                @ sub.up[index[t, s]]) for s in range(2)) for t in range(5)])
    torch.testing.assert_close(gathered, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, by_hand, rtol=1e-5, atol=1e-5)


def test_the_linear_term_travels_in_the_means_file_and_a_broken_one_is_refused(tmp_path):
    model = build_tiny("olmoe")
    windows = torch.randint(0, COMMON["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(6))
    plan = plan_of(model, 2)
    plan.means = measure_expert_means(model, windows, rank=2)
    plan.save(tmp_path / "p.json")
    loaded = load_plan(tmp_path / "p.json", model)
    assert loaded.means.rank == 2
    for index, term in plan.means.linear.items():
        for part in ("input_mean", "down", "up"):
            assert torch.equal(getattr(loaded.means.linear[index], part), getattr(term, part))

    from safetensors.torch import load, save
    sidecar = tmp_path / "p.means.safetensors"
    tensors = load(sidecar.read_bytes())
    del tensors["layer.1.up"]                                         # a term without its up projection
    data = save(tensors, metadata={"format": "allocmoe-expert-means", "tokens": "5", "rank": "2"})
    sidecar.write_bytes(data)
    with pytest.raises(AllocMoeError, match="layer 1's linear term is incomplete"):
        read_means(sidecar, hashlib.sha256(data).hexdigest(), "plan")


def test_a_cut_of_a_larger_fit_is_the_fit_at_the_smaller_rank():
    """auto fits its (k, rank) menu once at the largest rank and cuts it (ExpertMeans.truncated): each cut
    equals the reduced-rank fit made at that rank from the start."""
    model = build_tiny("olmoe")
    windows = torch.randint(0, COMMON["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(8))
    large = measure_expert_means(model, windows, rank=6)
    for rank in (0, 2, 3):
        direct = measure_expert_means(model, windows, rank=rank)
        cut = large.truncated({i: rank for i in large.means})
        assert cut.ranks == direct.ranks == {i: rank for i in large.means}
        for i in direct.means:
            assert torch.equal(cut.means[i], direct.means[i])
            for part in ("input_mean", "down", "up") if rank else ():
                torch.testing.assert_close(getattr(cut.linear[i], part), getattr(direct.linear[i], part),
                                           rtol=1e-5, atol=1e-6)
    with pytest.raises(AllocMoeError, match="rank 6; they cannot be cut to rank 7"):
        large.truncated({1: 7})


def test_per_layer_ranks_travel_in_the_means_file_and_a_mismatch_is_refused(tmp_path):
    model = build_tiny("olmoe")
    windows = torch.randint(0, COMMON["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(6))
    plan = plan_of(model, 2)
    plan.means = measure_expert_means(model, windows, rank=4).truncated({0: 4, 1: 0, 2: 2})
    plan.save(tmp_path / "p.json")
    loaded = load_plan(tmp_path / "p.json", model)
    assert loaded.means.ranks == {0: 4, 1: 0, 2: 2} and loaded.means.rank == 4
    for index, term in plan.means.linear.items():
        for part in ("input_mean", "down", "up"):
            assert torch.equal(getattr(loaded.means.linear[index], part), getattr(term, part))
    from allocmoe.routing.layout import standin_costs
    # priced per layer at its own rank: (2 H r + H) / (3 H I + H), H 32, I 48 (olmoe's tiny experts)
    assert loaded.cost()["standin_per_slot"] == pytest.approx({0: 288 / 4640, 1: 32 / 4640, 2: 160 / 4640})
    assert standin_costs(model, plan.means) == pytest.approx(loaded.cost()["standin_per_slot"])

    from safetensors.torch import load, save
    sidecar = tmp_path / "p.means.safetensors"
    tensors = load(sidecar.read_bytes())
    for ranks, message in (("0:4,1:2,2:2", "layer 1's linear term does not have rank|names linear terms"),
                           ("0:4,2:2", "per-layer ranks"), ("0:4,1:0,2:x", "per-layer ranks")):
        data = save(tensors, metadata={"format": "allocmoe-expert-means", "tokens": "5", "rank": "4", "ranks": ranks})
        sidecar.write_bytes(data)
        with pytest.raises(AllocMoeError, match=message):
            read_means(sidecar, hashlib.sha256(data).hexdigest(), "plan")


@pytest.mark.parametrize("argv, message", [
    (["--method", "uniform", "--substitute-rank", "4"], "--substitute-rank applies to the substitute"),
    (["--method", "auto", "--no-substitute", "--substitute-rank", "4"], "--substitute-rank applies to the substitute"),
    (["--method", "uniform", "--substitute", "--substitute-rank", "33"], "above this model's hidden size 32"),
    (["--method", "uniform", "--rank-menu"], "--rank-menu applies to auto's (k, stand-in) menu"),
    (["--method", "auto", "--substitute", "--rank-menu"], "--rank-menu applies to auto's (k, stand-in) menu"),
])
def test_a_rank_without_a_substitute_or_above_the_hidden_size_is_refused(tiny_folder, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["allocate", "--model", str(tiny_folder), "--budget", "0.5", "--output", str(tmp_path / "p.json"),
              *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_cli_writes_the_rank_it_was_given(tiny_folder, tmp_path):
    out = tmp_path / "half.json"
    main(["allocate", "--model", str(tiny_folder), "--method", "uniform", "--budget", "0.5", "--substitute",
          "--substitute-rank", "3", "--seq-len", "64", "--calib-tokens", "512", "--output", str(out), "--quiet"])
    assert Plan.load(out).means.rank == 3
    assert json.loads(out.read_text())["substitute"]["tokens"] > 0


def test_a_fit_whose_moments_would_not_fit_in_memory_is_refused_before_any_pass(monkeypatch):
    import allocmoe.core.memory

    model = build_tiny("olmoe")
    monkeypatch.setattr(allocmoe.core.memory, "available_memory_bytes", lambda device, meminfo=None: 100 << 10)   # 100 KiB free
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(1))
    windows = torch.randint(0, COMMON["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7))
    with pytest.raises(AllocMoeError, match=r"--substitute-rank 0 \(the means alone\)"):
        measure_expert_means(model, windows, rank=2)           # moments: 8 experts x 32 x 32 x 2 x 8 B = 128 KiB
    assert not passes
    assert measure_expert_means(model, windows, rank=0).rank == 0 and passes   # the means alone need no moments


def test_the_cli_refuses_a_fit_that_would_not_fit_before_loading(tiny_folder, tmp_path, capsys, monkeypatch):
    import allocmoe.core.memory

    monkeypatch.setattr(allocmoe.core.memory, "available_memory_bytes", lambda device, meminfo=None: 100 << 10)
    with pytest.raises(SystemExit) as exit_:
        main(["allocate", "--model", str(tiny_folder), "--method", "uniform", "--budget", "0.5", "--substitute",
              "--output", str(tmp_path / "p.json")])
    assert exit_.value.code == 2 and "--substitute-rank 0 (the means alone)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
