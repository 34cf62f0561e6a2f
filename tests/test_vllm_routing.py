"""The vLLM plugin's restated routers (integrations/vllm_routing.py) against allocmoe's own adapters.

Inside vLLM the plugin never sees a transformers router: it reads vLLM's router settings (scoring,
renormalize, scaling, correction bias, groups) and restates the routing from the step's logits. Here,
for every family, those settings are written as vLLM derives them from the model's config, and the
pairs each token keeps and their weights must equal what allocmoe's family adapter and policies give
on the same logits (routing/adapters, core/policies): every policy, stand-ins' full-K weights, the
distinct budget over a step, and several plans side by side. Runs without vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from allocmoe.core.policies import AllocT, DistinctExperts, NaeeSkip, StaticTopK, TopP, prefix_mask
from allocmoe.integrations.vllm_routing import RouterSpec, select
from allocmoe.routing.adapters import adapter_for_model
from conftest import FAMILIES, build_tiny

TOKENS = 24


def vllm_router(model_type: str, config, hf_router) -> SimpleNamespace:
    """The router settings vLLM 0.32 builds for the family (its model files' FusedMoE arguments)."""
    router = SimpleNamespace(custom_routing_function=None, scoring_func="softmax", use_grouped_topk=False,
                             num_expert_group=None, topk_group=None, routed_scaling_factor=1.0,
                             e_score_correction_bias=None,
                             renormalize=bool(getattr(config, "norm_topk_prob", True)))
    if model_type in ("olmoe", "qwen2_moe"):
        router.renormalize = bool(config.norm_topk_prob)
    if model_type in ("mixtral", "gpt_oss", "granitemoe", "granitemoeshared"):
        router.renormalize = True
    if model_type.startswith("deepseek"):
        router.use_grouped_topk = True
        router.num_expert_group, router.topk_group = config.n_group, config.topk_group
        router.routed_scaling_factor = config.routed_scaling_factor
        router.renormalize = bool(getattr(config, "norm_topk_prob", False))
    if model_type == "deepseek_v3":
        router.scoring_func, router.e_score_correction_bias = "sigmoid", hf_router.e_score_correction_bias
    return router


def dense(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] weight of each kept (token, expert) pair, 0 elsewhere."""
    return torch.zeros(ids.size(0), num_experts).scatter_add_(1, ids.long(), (weights * keep).float())


def kept(selection) -> torch.Tensor:
    return prefix_mask(selection.counts, selection.ids.size(1))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def routed(request):
    torch.manual_seed(1)
    model = build_tiny(request.param)
    adapter = adapter_for_model(model)
    layer = adapter.moe_layers(model)[0]
    hidden = torch.randn(TOKENS, model.config.hidden_size)
    with torch.no_grad():
        scores = adapter.score(layer.router, hidden)
    spec = RouterSpec.of(vllm_router(request.param, model.config, layer.router), adapter.k_orig(), layer.index)
    return adapter, layer, scores, spec


def allocmoe_choice(adapter, layer, scores, policy, batch_size=1):
    """allocmoe's own: candidates, the policy's keep, the family's weights ([T, K] each)."""
    k_orig = adapter.k_orig()
    cand_idx = scores.ranking.topk(k_orig, dim=-1).indices
    cand_probs = scores.probs.gather(-1, cand_idx).cummin(-1).values
    valid = torch.ones(cand_idx.size(0), dtype=torch.bool)
    if isinstance(policy, DistinctExperts):
        index, keep, _, _ = policy.select(cand_idx, cand_probs, scores.probs, valid, batch_size)
    else:
        index, keep = cand_idx, prefix_mask(policy.counts(cand_probs, valid, batch_size), k_orig)
    return index, keep, adapter.combine(layer.router, scores, index, keep)


POLICIES = {"static-1": lambda k: StaticTopK(1), "static-k-1": lambda k: StaticTopK(k - 1),
            "alloc-t": lambda k: AllocT(0.6 * k + 0.1, pool="sequence"), "top-p": lambda k: TopP(0.6),
            "naee": lambda k: NaeeSkip(0.3)}


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_each_policy_keeps_the_pairs_and_weights_allocmoe_gives(routed, policy_name):
    adapter, layer, scores, spec = routed
    policy = POLICIES[policy_name](adapter.k_orig())
    index, keep, weights = allocmoe_choice(adapter, layer, scores, policy)
    selection = select(spec, scores.logits, [(0, TOKENS, 0)], [policy], [False])
    num_experts = scores.probs.size(-1)
    assert torch.equal(selection.counts, keep.sum(-1))
    torch.testing.assert_close(dense(selection.ids, selection.weights, kept(selection), num_experts),
                               dense(index, weights, keep, num_experts), rtol=1e-5, atol=1e-6)
    dropped = ~kept(selection)
    assert (selection.weights[dropped] == 0).all()       # a dropped slot carries nothing, whatever its id


def test_the_full_model_equals_the_family_router(routed):
    adapter, layer, scores, spec = routed
    k_orig = adapter.k_orig()
    index, keep, weights = allocmoe_choice(adapter, layer, scores, StaticTopK(k_orig))
    selection = select(spec, scores.logits, [(0, TOKENS, 0)], [StaticTopK(k_orig)], [False])
    assert (selection.counts == k_orig).all()
    assert torch.equal(selection.ids.long().sort(-1).values, index.sort(-1).values)      # the native top-K set


def test_stand_in_rows_keep_full_k_weights_and_name_what_they_skip(routed):
    adapter, layer, scores, spec = routed
    k_orig = adapter.k_orig()
    cand_idx = scores.ranking.topk(k_orig, dim=-1).indices
    full = adapter.combine(layer.router, scores, cand_idx, torch.ones_like(cand_idx, dtype=torch.bool))   # [T, K]
    half = TOKENS // 2        # two requests: the first under a plan with stand-ins, the second without
    segments = [(0, half, 0), (half, TOKENS, 1)]
    selection = select(spec, scores.logits, segments, [StaticTopK(1), StaticTopK(1)], [True, False])
    num_experts = scores.probs.size(-1)
    top1 = torch.zeros_like(cand_idx, dtype=torch.bool)
    top1[:, 0] = True
    kept_dense = dense(selection.ids, selection.weights, kept(selection), num_experts)
    torch.testing.assert_close(kept_dense[:half], dense(cand_idx, full, top1, num_experts)[:half], rtol=1e-5, atol=1e-6)
    skipped = dense(selection.skipped_ids, selection.skipped_weights, torch.ones_like(top1), num_experts)
    torch.testing.assert_close(skipped[:half], dense(cand_idx, full, ~top1, num_experts)[:half], rtol=1e-5, atol=1e-6)
    assert (skipped[half:] == 0).all()                    # the plan without stand-ins adds nothing
    _, keep, weights = allocmoe_choice(adapter, layer, scores, StaticTopK(1))
    expected = dense(cand_idx, weights, keep, num_experts)
    torch.testing.assert_close(kept_dense[half:], expected[half:], rtol=1e-5, atol=1e-6)


def test_a_distinct_plan_caps_one_decode_step_over_its_requests_tokens(routed):
    adapter, layer, scores, spec = routed
    policy = DistinctExperts(3)
    index, keep, weights = allocmoe_choice(adapter, layer, scores, policy, batch_size=TOKENS)   # one step
    segments = [(t, t + 1, 0) for t in range(TOKENS)]                                           # T decode requests
    selection = select(spec, scores.logits, segments, [policy], [False])
    num_experts = scores.probs.size(-1)
    torch.testing.assert_close(dense(selection.ids, selection.weights, kept(selection), num_experts),
                               dense(index, weights, keep, num_experts), rtol=1e-5, atol=1e-6)
    loaded = torch.unique(selection.ids[kept(selection)]).numel()
    assert selection.loaded == [loaded] and loaded <= 3


def test_requests_under_different_plans_each_choose_as_alone(routed):
    adapter, layer, scores, spec = routed
    plans = [StaticTopK(1), AllocT(1.5, pool="sequence"), TopP(0.5)]
    bounds = [0, 5, 13, TOKENS]
    segments = [(bounds[i], bounds[i + 1], i) for i in range(3)]
    mixed = select(spec, scores.logits, segments, plans, [False] * 3)
    for (start, end, i) in segments:
        alone = select(spec, scores.logits[start:end], [(0, end - start, 0)], [plans[i]], [False])
        width = alone.ids.size(1)
        assert torch.equal(mixed.counts[start:end], alone.counts)
        assert torch.equal(mixed.ids[start:end, :width], alone.ids)
        torch.testing.assert_close(mixed.weights[start:end, :width], alone.weights)


@pytest.mark.parametrize("max_experts", [1, 2, 8])
def test_a_distinct_plans_prompt_tokens_are_each_a_step_as_in_allocmoe(routed, max_experts):
    adapter, layer, scores, spec = routed
    policy = DistinctExperts(max_experts)
    index, keep, weights = allocmoe_choice(adapter, layer, scores, policy, batch_size=1)   # T steps of 1
    selection = select(spec, scores.logits, [(0, TOKENS, 0)], [policy], [False])           # one prompt
    num_experts = scores.probs.size(-1)
    torch.testing.assert_close(dense(selection.ids, selection.weights, kept(selection), num_experts),
                               dense(index, weights, keep, num_experts), rtol=1e-5, atol=1e-6)


def test_one_token_requests_keep_what_their_own_pool_counts(routed):
    """Decode requests take the router's one-k fast path (routing/select.py: static_k), not the pool."""
    adapter, layer, scores, spec = routed
    k_orig = adapter.k_orig()
    policy = AllocT(0.6 * k_orig + 0.1)
    selection = select(spec, scores.logits, [(t, t + 1, 0) for t in range(TOKENS)], [policy], [False])
    cand_idx = scores.ranking.topk(k_orig, dim=-1).indices
    cand_probs = scores.probs.gather(-1, cand_idx).cummin(-1).values
    one = torch.ones(1, dtype=torch.bool)
    expected = torch.cat([policy.counts(cand_probs[t:t + 1], one, 1) for t in range(TOKENS)])
    assert torch.equal(selection.counts, expected)
    index, keep, weights = allocmoe_choice(adapter, layer, scores, StaticTopK(int(expected[0])))
    num_experts = scores.probs.size(-1)
    torch.testing.assert_close(dense(selection.ids, selection.weights, kept(selection), num_experts),
                               dense(index, weights, keep, num_experts), rtol=1e-5, atol=1e-6)
