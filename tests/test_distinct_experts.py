"""The distinct-expert budget (policy `distinct`, issue 23): at most M distinct experts per decode
step and layer. The policy against a per-step loop written from the documented rule; the bound, the
floor and the top-k limit on random tables and on tiny models of every family; `eval --decode-batch`
grouping against what the batched engine routes, token for token; plan files, engines that refuse
it, and the server and generate taking it like any other plan."""

from __future__ import annotations

import json
import re

import pytest
import torch

from allocmoe import AllocMoeError, AllocT, Plan, StaticTopK, apply_plan, evaluate_perplexity, model_fingerprint
from allocmoe.core import policies
from allocmoe.core.policies import DistinctExperts, distinct_per_step, select_experts
from conftest import policy_from_layer_entry
from allocmoe.routing.apply import distinct_plan
from allocmoe.routing.layout import load_plan
from conftest import build_tiny


def table(num_tokens, num_experts=16, seed=0, spread=2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_experts, generator=gen).mul(spread).softmax(-1)    # [T, E]


def reference(probs, valid, batch_size, k_orig, max_experts, k_floor):
    """The documented rule, one step and one token at a time: (kept expert sets, top-1 outside)."""
    num_tokens, num_experts = probs.shape
    steps = num_tokens // batch_size
    cand = probs.topk(k_orig, dim=-1).indices.tolist()
    kept, outside = [set() for _ in range(num_tokens)], [False] * num_tokens
    for s in range(steps):
        tokens = [b * steps + s for b in range(batch_size) if valid[b * steps + s]]
        score = {}
        for t in tokens:
            for r in range(k_orig):
                e = cand[t][r]          # summed in float32, in token order, as a router sums them
                score[e] = float(torch.tensor(score.get(e, 0.0), dtype=torch.float32) + probs[t, e].float())
        floor = 0
        for f in range(1, k_floor + 1):
            if len({cand[t][r] for t in tokens for r in range(f)}) <= max_experts:
                floor = f
        first = {cand[t][r] for t in tokens for r in range(max(floor, 1))}
        order = sorted(score, key=lambda e: (e not in first, -score[e], e))
        chosen = set(order[:max_experts])
        for t in tokens:
            kept[t] = {e for e in cand[t] if e in chosen}
            if not kept[t]:
                kept[t] = {max(chosen, key=lambda e: (float(probs[t, e]), -e))}
            outside[t] = cand[t][0] not in chosen
    return kept, outside


def kept_sets(index, num_experts):
    return [{int(e) for e in row if e < num_experts} for row in index]


@pytest.fixture(params=["host", "tensors"])
def selection_path(request, monkeypatch):
    """Run a test on both ways the policy chooses on CPU: Python lists for small passes (decode
    steps), tensor operations for large ones (as on every other device)."""
    if request.param == "tensors":
        monkeypatch.setattr(policies, "HOST_SELECT_MAX_SLOTS", 0)
    return request.param


@pytest.mark.parametrize("batch_size,steps,max_experts,k_floor", [
    (8, 3, 4, 1), (8, 3, 2, 1), (16, 2, 6, 2), (4, 5, 1, 1), (6, 4, 10, 3), (16, 1, 16, 1), (5, 3, 3, 2)])
def test_the_selection_follows_the_documented_rule_step_by_step(batch_size, steps, max_experts, k_floor, selection_path):
    num_tokens, k_orig = batch_size * steps, 6
    probs = table(num_tokens, seed=batch_size * 7 + max_experts)
    valid = torch.ones(num_tokens, dtype=torch.bool)
    valid[1::5] = False                                                   # some padding in every layout
    cand_probs, cand_idx = probs.topk(k_orig, dim=-1)
    policy = DistinctExperts(max_experts, k_floor)
    index, keep, outside, distinct = policy.select(cand_idx, cand_probs, probs, valid, batch_size)
    expected, expected_outside = reference(probs, valid, batch_size, k_orig, max_experts, k_floor)
    assert kept_sets(index.masked_fill(~keep, 16), 16) == expected
    assert outside.tolist() == [o and bool(v) for o, v in zip(expected_outside, valid)]
    loaded = [set().union(*(expected[b * steps + s] for b in range(batch_size))) for s in range(steps)]
    assert distinct.tolist() == [len(experts) for experts in loaded]


@pytest.mark.parametrize("kind", ["ties", "tiny", "underflow"])
@pytest.mark.parametrize("k_floor", [1, 2])
def test_ties_go_to_the_lower_expert_and_scores_order_across_magnitudes(kind, k_floor, selection_path):
    """The order is exact: equal summed scores go to the lower expert index, and scores many orders
    of magnitude apart (down to probabilities that underflow to 0) still order as numbers do."""
    batch_size, steps, k_orig = 8, 3, 6
    if kind == "ties":       # multiples of 1/16: many equal sums, all exact in float32 and float64
        probs = (table(batch_size * steps, seed=5) * 16).round().clamp(min=1) / 16
    else:                    # a sharp router: the tail spans 1e-3 .. 1e-40, or reaches 0
        probs = table(batch_size * steps, seed=6, spread=25.0 if kind == "tiny" else 60.0)
    valid = torch.ones(batch_size * steps, dtype=torch.bool)
    valid[3] = False
    cand_probs, cand_idx = probs.topk(k_orig, dim=-1)
    for max_experts in (1, 3, 5, 9):
        policy = DistinctExperts(max_experts, k_floor)
        index, keep, outside, distinct = policy.select(cand_idx, cand_probs, probs, valid, batch_size)
        expected, expected_outside = reference(probs, valid, batch_size, k_orig, max_experts, k_floor)
        assert kept_sets(index.masked_fill(~keep, 16), 16) == expected
        assert outside.tolist() == [o and bool(v) for o, v in zip(expected_outside, valid)]
    if kind == "underflow":
        assert (cand_probs == 0).any()        # the case is real: some candidates hold probability 0


@pytest.mark.parametrize("seed", range(4))
def test_both_selection_paths_choose_the_same(seed, monkeypatch):
    """Lists and tensors agree on random layouts, budgets and floors, with padding, exact ties and
    probabilities spanning many orders of magnitude (summed in float32 in the same order)."""
    gen = torch.Generator().manual_seed(seed)
    for case in range(60):
        batch_size, steps = int(torch.randint(1, 17, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        probs = table(batch_size * steps, seed=seed * 1000 + case, spread=[1.0, 6.0, 60.0][case % 3])
        if case % 4 == 0:
            probs = (probs * 8).round() / 8 + 1e-3                       # many equal sums
        valid = torch.rand(batch_size * steps, generator=gen) > 0.2
        cand_probs, cand_idx = probs.topk(6, dim=-1)
        policy = DistinctExperts(int(torch.randint(1, 20, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen)))
        on_host = policy.select(cand_idx, cand_probs, probs, valid, batch_size)
        monkeypatch.setattr(policies, "HOST_SELECT_MAX_SLOTS", 0)
        with_tensors = policy.select(cand_idx, cand_probs, probs, valid, batch_size)
        monkeypatch.undo()
        for a, b in zip(on_host, with_tensors):
            assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_no_step_loads_more_than_m_experts_and_every_token_keeps_its_floor_when_it_fits(seed, selection_path):
    gen = torch.Generator().manual_seed(seed)
    batch_size, steps, k_orig, num_experts = int(torch.randint(1, 17, (1,), generator=gen)), 3, 6, 32
    probs = table(batch_size * steps, num_experts, seed=seed, spread=float(torch.rand(1, generator=gen)) * 4)
    valid = torch.rand(batch_size * steps, generator=gen) > 0.2
    cand_idx = probs.topk(k_orig, dim=-1).indices
    for max_experts in (1, 2, 3, 5, 8, 13, 21, 32):
        for k_floor in (1, 2, 3):
            _, index = select_experts(probs, DistinctExperts(max_experts, k_floor), k_orig, valid, batch_size)
            distinct, real = distinct_per_step(index, valid, batch_size, num_experts)
            assert int(distinct.max()) <= max_experts
            kept = (index < num_experts).sum(-1)
            assert kept[valid].min() >= 1 and kept[~valid].eq(0).all() and kept.max() <= k_orig
            for s in range(steps):
                rows = [b * steps + s for b in range(batch_size) if valid[b * steps + s]]
                floor_union = {int(e) for t in rows for e in cand_idx[t, :k_floor]}
                if len(floor_union) <= max_experts:        # the floor fits: every token keeps its top k_floor
                    for t in rows:
                        assert set(cand_idx[t, :k_floor].tolist()) <= set(index[t].tolist())


def test_m_at_least_e_is_plain_top_k():
    probs = table(48, num_experts=16, seed=3)
    valid = torch.ones(48, dtype=torch.bool)
    for batch_size in (1, 4, 16):
        weights, index = select_experts(probs, DistinctExperts(16), 6, valid, batch_size)
        top_w, top_i = select_experts(probs, StaticTopK(6), 6, valid, batch_size)
        assert torch.equal(index, top_i) and torch.equal(weights, top_w)


def test_a_token_may_keep_its_first_and_third_choice_and_a_stranded_token_gets_the_best_chosen_expert(selection_path):
    # two tokens in one step, K = 3 of E = 5; token 0 ranks 0 > 1 > 2, token 1 ranks 2 > 3 > 0
    probs = torch.tensor([[0.50, 0.30, 0.15, 0.03, 0.02],
                          [0.20, 0.01, 0.60, 0.17, 0.02]])
    cand_probs, cand_idx = probs.topk(3, dim=-1)
    index, keep, outside, _ = DistinctExperts(2).select(cand_idx, cand_probs, probs, torch.ones(2, dtype=torch.bool), 2)
    assert kept_sets(index.masked_fill(~keep, 5), 5) == [{0, 2}, {2, 0}]     # token 0 keeps its 1st and 3rd
    assert not outside.any()
    # M = 1: the top-1s (0 and 2) do not fit; they still go first, and 2 (summed 0.75) beats 0 (0.70)
    index, keep, outside, _ = DistinctExperts(1).select(cand_idx, cand_probs, probs, torch.ones(2, dtype=torch.bool), 2)
    assert kept_sets(index.masked_fill(~keep, 5), 5) == [{2}, {2}] and outside.tolist() == [True, False]
    # three tokens, M = 2: the top-1s 0, 3, 4 do not fit; 3 (1.06) and 4 (0.86) beat 0 (0.40), so token 0
    # has no chosen candidate and keeps the chosen expert it gives the most probability (4: 0.06 > 0.04)
    probs = torch.tensor([[0.40, 0.30, 0.20, 0.04, 0.06],
                          [0.01, 0.01, 0.02, 0.80, 0.16],
                          [0.01, 0.02, 0.01, 0.26, 0.70]])
    cand_probs, cand_idx = probs.topk(3, dim=-1)
    index, keep, outside, _ = DistinctExperts(2).select(cand_idx, cand_probs, probs, torch.ones(3, dtype=torch.bool), 3)
    assert kept_sets(index.masked_fill(~keep, 5), 5) == [{4}, {3, 4}, {3, 4}] and outside.tolist() == [True, False, False]


# -- on models ----------------------------------------------------------------------------------

def distinct_recorder(num_experts, seen):
    def record(layer, cand_idx, cand_probs, counts, valid):
        kept = torch.arange(cand_idx.size(1))[None, :] < counts[:, None]
        seen.append((layer, cand_idx.masked_fill(~kept, num_experts), valid))
    return record


@torch.no_grad()
def test_on_every_family_no_step_exceeds_m_and_m_at_e_is_the_unmodified_model(family_model):
    _, model = family_model
    fp = model_fingerprint(model)
    ids = torch.randint(0, 96, (6, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                                       # left padding is never counted
    reference_logits = model(input_ids=ids, attention_mask=mask).logits
    with apply_plan(model, distinct_plan(model, fp["num_experts"])) as handle:
        patched = model(input_ids=ids, attention_mask=mask).logits
        assert (patched - reference_logits)[mask.bool()].abs().max() <= 1e-5      # padding routes nothing
        assert handle.activations_per_token() == pytest.approx(fp["k_orig"] * fp["num_moe_layers"])
    for max_experts in (1, 3):
        seen = []
        with apply_plan(model, distinct_plan(model, max_experts)) as handle:
            handle.context.recorders.append(distinct_recorder(fp["num_experts"], seen))
            model(input_ids=ids, attention_mask=mask)
            assert handle.max_distinct_experts_per_step() <= max_experts
            assert set(handle.top1_outside_rate()) == set(fp["moe_layers"])
            per_layer = handle.layer_distinct_experts()
        for layer, index, valid in seen:                                 # counted independently of the handle
            distinct, _ = distinct_per_step(index, valid, 6, fp["num_experts"])
            assert int(distinct.max()) <= max_experts
            assert per_layer[layer]["max"] == int(distinct.max()) and per_layer[layer]["steps"] == 9
            assert (index < fp["num_experts"]).sum(-1)[valid].min() >= 1


@pytest.mark.parametrize("fold_passes", [1, 2, 10_000])
@torch.no_grad()
def test_the_handle_counts_many_passes_the_same_whenever_it_sums_them(fold_passes, monkeypatch):
    """The distinct policy's passes are summed when read or every FOLD_PASSES passes: over a batched
    generation (one prefill, then decode steps of 3 sequences) the handle's counts equal a count of
    what the recorders saw, whenever the sums are taken."""
    from allocmoe.routing.apply import LayerStats

    model = build_tiny("qwen3_moe")
    fp = model_fingerprint(model)
    ids = torch.randint(1, 96, (3, 5), generator=torch.Generator().manual_seed(9))

    def generate(fold):
        monkeypatch.setattr(LayerStats, "FOLD_PASSES", fold)
        seen = []
        with apply_plan(model, distinct_plan(model, 2)) as handle:     # M = 2: some top-1s left out
            handle.context.recorders.append(distinct_recorder(fp["num_experts"], seen))
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
            return seen, handle.layer_distinct_experts(), handle.layer_activations(), handle.top1_outside_rate()

    seen, per_layer, activations, outside = generate(fold_passes)
    assert outside == generate(10**9)[3] and all(outside.values())          # against summing once, at the end
    for layer in fp["moe_layers"]:
        passes = [(index, valid) for at, index, valid in seen if at == layer]
        counted = [distinct_per_step(index, valid, 3, fp["num_experts"]) for index, valid in passes]
        steps = torch.cat([d[r] for d, r in counted])
        assert per_layer[layer] == {"mean": pytest.approx(steps.float().mean().item()), "max": int(steps.max()),
                                    "steps": steps.numel()}
        kept = sum(int((index < fp["num_experts"])[valid].sum()) for index, valid in passes)
        assert activations[layer] == pytest.approx(kept / sum(int(valid.sum()) for _, valid in passes))


@torch.no_grad()
def test_counts_kept_for_later_do_not_change_when_the_callers_mask_does():
    """The handle sums the distinct policy's passes when read; a bool attention mask the caller
    reuses and overwrites after the pass must not change what was counted."""
    model = build_tiny("qwen3_moe")
    ids = torch.randint(1, 96, (4, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, :2] = False
    with apply_plan(model, distinct_plan(model, 2)) as handle:
        model(input_ids=ids, attention_mask=mask)
        mask.zero_()                                                      # the caller's next use
        assert handle.tokens_seen() == 22


@torch.no_grad()
def test_step_counters_for_other_policies_are_opt_in_and_reset(ids):
    model = build_tiny("olmoe")
    with apply_plan(model, Plan(model=model_fingerprint(model), layers={i: StaticTopK(2) for i in range(3)},
                                method="t", budget=6.0)) as handle:
        model(ids)
        assert handle.distinct_experts_per_step() is None and handle.top1_outside_rate() == {}
        handle.context.count_steps = True
        model(ids)
        assert 2 <= handle.distinct_experts_per_step() <= handle.max_distinct_experts_per_step() <= 4
        handle.reset_counters()
        assert handle.layer_distinct_experts() == {} and handle.tokens_seen() == 0


# -- eval --decode-batch against the batched engine -----------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from allocmoe import load_model

    return load_model(str(tiny_folder))


def engine_selections(model, tok, plan, prompts, new_tokens):
    """Run the prompts through the engine side by side; each (layer, row, position) -> kept experts."""
    from allocmoe.serve import Engine, Request, SamplingParams

    num_experts, rows = model_fingerprint(model)["num_experts"], len(prompts)
    kept, passes = {}, []
    with apply_plan(model, plan) as handle:
        handle.context.recorders.append(lambda layer, idx, probs, counts, valid: passes.append((layer, idx, counts)))
        engine = Engine(model, tok, handle, max_batch_size=rows)
        requests = [engine.submit(Request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))
                    for p in prompts]
        engine.run_until_idle()
    offset = {}
    for layer, idx, counts in passes:
        width = idx.size(0) // rows                                        # positions in this pass
        start = offset.get(layer, 0)
        for t in range(idx.size(0)):
            kept[layer, t // width, start + t % width] = frozenset(idx[t, :counts[t]].tolist())
        offset[layer] = start + width
    return kept, [r.generated for r in requests]


def eval_selections(model, plan, windows):
    kept, rows = {}, windows.size(0)
    with apply_plan(model, plan) as handle:
        handle.context.recorders.append(lambda layer, idx, probs, counts, valid: [
            kept.__setitem__((layer, t // windows.size(1), t % windows.size(1)), frozenset(idx[t, :counts[t]].tolist()))
            for t in range(idx.size(0))])
        evaluate_perplexity(model, None, "", {"decode_batch": rows, "progress": False}, windows=windows)
        return kept, handle.max_distinct_experts_per_step()


@pytest.mark.parametrize("policy,prefill_steps", [(DistinctExperts(3), True), (AllocT(2.5, 1), False)])
@torch.no_grad()
def test_eval_decode_batch_routes_every_token_as_the_batched_engine_does(tiny, policy, prefill_steps):
    """Prompts of one length decoded side by side by the engine, then the same tokens teacher-forced
    through `evaluate_perplexity(decode_batch=B)`: the same experts for every token, in every layer.
    Prefill is one pass of [B, P]; distinct's steps are its columns there too, while Alloc-T pools
    the whole prompt, so for Alloc-T only the decode positions are compared."""
    model, tok = tiny
    fp = model_fingerprint(model)
    plan = Plan(model=fp, layers={i: policy for i in fp["moe_layers"]}, method="test", budget=float(fp["num_moe_layers"] * 3))
    gen = torch.Generator().manual_seed(11)
    rows, prompt_len, new_tokens = 4, 5, 6
    prompts = [torch.randint(1, len(tok), (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    served, generated = engine_selections(model, tok, plan, prompts, new_tokens)
    windows = torch.tensor([p + g[:-1] for p, g in zip(prompts, generated)])   # what the decode steps fed
    scored, most = eval_selections(model, plan, windows)
    first = 0 if prefill_steps else prompt_len
    compared = [key for key in served if key[2] >= first]
    assert len(compared) == fp["num_moe_layers"] * rows * (windows.size(1) - first)
    assert all(served[key] == scored[key] for key in compared)
    if isinstance(policy, DistinctExperts):
        assert most <= 3 and sum(len(served[key]) for key in compared) > len(compared)    # tokens kept > 1


def test_eval_decode_batch_tops_up_the_last_pass_and_scores_each_window_once(tiny):
    model, tok = tiny
    windows = torch.randint(1, len(tok), (5, 12), generator=torch.Generator().manual_seed(2))
    plain = evaluate_perplexity(model, tok, "", {"windows_per_pass": 5, "progress": False}, windows=windows)
    batched = evaluate_perplexity(model, tok, "", {"decode_batch": 3, "progress": False}, windows=windows)
    assert batched.tokens == plain.tokens == 5 * 11 and batched.windows == 5
    assert batched.nll == pytest.approx(plain.nll, rel=1e-5)               # unmodified model: grouping is free
    with pytest.raises(AllocMoeError, match="--decode-batch 6 needs at least 6 windows of 12 tokens, but the text gives 5"):
        evaluate_perplexity(model, tok, "", {"decode_batch": 6, "progress": False}, windows=windows)


def test_eval_cli_decode_batch_reports_steps(tiny_folder, tmp_path, capsys):
    from allocmoe import load_model
    from allocmoe.cli import main

    model, _ = load_model(str(tiny_folder))
    plan_file = tmp_path / "d.json"
    distinct_plan(model, 2).save(plan_file)
    out = tmp_path / "r.json"
    main(["eval", "--model", str(tiny_folder), "--plan", str(plan_file), "--decode-batch", "4", "--seq-len", "32",
          "--eval-tokens", "300", "--quiet", "--output", str(out)])
    result = json.loads(out.read_text())
    assert result["decode_batch"] == 4 and result["max_distinct_experts_per_step"] <= 2
    assert 1 <= result["distinct_experts_per_step"] <= 2 and 0 <= result["top1_outside_chosen_rate"] <= 1
    assert set(result["distinct_experts_per_layer"]) == {str(i) for i in model_fingerprint(model)["moe_layers"]}
    assert "distinct experts per step" in capsys.readouterr().err
    main(["eval", "--model", str(tiny_folder), "--decode-batch", "4", "--seq-len", "32", "--eval-tokens", "300",
          "--quiet", "--output", str(out)])                                  # no plan: the unmodified selection
    result = json.loads(out.read_text())
    assert result["plan"] is None and result["max_distinct_experts_per_step"] > 2
    assert result["top1_outside_chosen_rate"] is None
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", str(tiny_folder), "--decode-batch", "400", "--seq-len", "32", "--eval-tokens", "300"])
    assert exit_info.value.code == 2
    assert "needs at least 400 windows" in capsys.readouterr().err


# -- plan files, engines, serving -------------------------------------------------------------------

def test_a_distinct_plan_round_trips_and_bad_entries_are_refused(tmp_path):
    model = build_tiny("qwen3_moe")
    plan = distinct_plan(model, [2, 3, 4], k_floor=2)
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["layers"]["0"] == {"policy": "distinct", "max_experts": 2, "k_floor": 2}
    assert load_plan(tmp_path / "p.json", model).layers == plan.layers
    assert policy_from_layer_entry({"policy": "distinct", "max_experts": 5, "k": 2.5}, k_orig=4) == DistinctExperts(5, 1, 2.5)
    for entry, message in [({"policy": "distinct"}, "max_experts: missing field"),
                           ({"policy": "distinct", "max_experts": 0}, "max_experts"),
                           ({"policy": "distinct", "max_experts": 2.5}, "must be a whole number"),
                           ({"policy": "distinct", "max_experts": 4, "k_floor": 5}, "k_floor 5 is above k_orig 4"),
                           ({"policy": "distinct", "max_experts": 4, "floor": 1}, "floor: unknown field")]:
        with pytest.raises(AllocMoeError, match=re.escape(message)):
            policy_from_layer_entry(entry, k_orig=4)
    data["layers"]["1"]["k_floor"] = 9
    with pytest.raises(AllocMoeError, match="layer 1: k_floor 9 is above k_orig 4"):
        Plan.from_dict(data)


def test_export_takes_a_distinct_plan_to_vllm_only_and_refuses_engine_wide_k_in_one_line(tmp_path):
    from types import SimpleNamespace

    from allocmoe.integrations.export import export_plan
    from allocmoe.integrations.vllm_plugin import _check_plan

    model = build_tiny("qwen3_moe")
    path = tmp_path / "d.json"
    distinct_plan(model, 3).save(path)
    for fmt in ("vllm-global", "sglang", "llama.cpp"):
        with pytest.raises(AllocMoeError, match="distinct-expert budget") as exc:
            export_plan(fmt, {None: path})
        assert "\n" not in str(exc.value) and "--format vllm" in str(exc.value)
    assert export_plan("vllm", {None: path}).env["ALLOCMOE_PLAN"] == str(path.resolve())
    _check_plan(Plan.load(path), SimpleNamespace(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=4), None)


@torch.no_grad()
def test_generate_and_the_server_take_a_distinct_plan_like_any_other(tiny):
    from allocmoe import generate
    from allocmoe.serve import Engine, Request, SamplingParams
    from allocmoe.serve.plans import PlanRegistry

    model, tok = tiny
    plan = distinct_plan(model, 2)
    stream = generate(model, tok, "the king", plan, max_new_tokens=5)
    list(stream)
    assert stream.summary.new_tokens >= 1
    assert 4 <= stream.summary.prefill_activations_per_token <= model_fingerprint(model)["num_moe_layers"] * 4
    registry = PlanRegistry(model, "tiny", plans={"d": plan})
    try:
        engine = Engine(model, tok, registry.handle, max_batch_size=4)
        index, _ = registry.resolve(None, "d", None)
        requests = [engine.submit(Request(tok(p)["input_ids"], SamplingParams(max_new_tokens=4), plan_index=index))
                    for p in ("one", "two words", "a third prompt", "and four")]
        registry.handle.context.count_steps = True
        engine.run_until_idle()
        assert all(r.finish_reason in ("stop", "length") for r in requests)
        assert registry.handle.max_distinct_experts_per_step() <= 2
    finally:
        registry.close()
