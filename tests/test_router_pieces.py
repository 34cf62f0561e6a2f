"""The router's pieces one at a time (routing/select.py, routing/router.py), each against a hand
count or a brute-force loop; tests/test_apply.py checks them together, as the installed router.

Shape legend: T = tokens, E = experts, K = K_orig, B = rows, S = positions per row, H = hidden size.
"""

from __future__ import annotations

import pytest
import torch

from allocmoe.core.policies import AllocT, DistinctExperts, NaeeSkip, StaticTopK, TopP
from allocmoe.routing.adapters import adapter_for_model
from allocmoe.routing.router import (LayerStats, RoutingContext, count, count_static, record, static_route, weigh,
                                     weigh_rows)
from allocmoe.routing.select import (Choice, candidates, choose, choose_rows, kept_first, kept_first_order,
                                     row_tokens, static_k)
from allocmoe.routing.substitute import LayerSubstitute
from conftest import build_tiny


def table(num_tokens: int = 6, num_experts: int = 8, seed: int = 0) -> torch.Tensor:
    """probs [T, E]: a random distribution per token, no ties."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, num_experts, generator=gen) * 2).softmax(-1)


# -- select ----------------------------------------------------------------------------------------
def test_candidates_are_the_ranking_top_k_with_probabilities_made_non_increasing():
    probs = table()
    ranking = probs + torch.linspace(0.2, 0.0, probs.size(1))           # another key than probs
    cand_idx, cand_probs = candidates(ranking, probs, 3)
    for t in range(probs.size(0)):
        order = sorted(range(probs.size(1)), key=lambda e: -float(ranking[t, e]))[:3]
        assert cand_idx[t].tolist() == order
        running = []
        for e in order:                                                # each at most the one before
            running.append(min([float(probs[t, e])] + running[-1:]))
        assert cand_probs[t].tolist() == pytest.approx(running)
    same_idx, same_probs = candidates(probs, probs, 3)                 # ranked by probability itself
    assert torch.equal(same_probs, probs.sort(-1, descending=True).values[:, :3])
    assert torch.equal(same_idx, probs.argsort(-1, descending=True)[:, :3])


def test_static_k_is_the_one_k_a_policy_cannot_vary():
    one, two = torch.ones(1, dtype=torch.bool), torch.ones(2, dtype=torch.bool)
    assert static_k(StaticTopK(3), two) == 3
    assert static_k(AllocT(2.5, k_base=1), one) == 3                  # 1 + floor(1.5 + 0.5)
    assert static_k(AllocT(2.4, k_base=1), one) == 2                  # 1 + floor(1.4 + 0.5)
    assert static_k(AllocT(2.5), two) is None                         # two tokens share a pool
    assert static_k(AllocT(2.5), torch.zeros(1, dtype=torch.bool)) is None   # a padding token
    assert static_k(TopP(0.5), one) is None and static_k(DistinctExperts(2), one) is None


@pytest.mark.parametrize("k_base", [0, 1])
def test_static_k_of_alloc_t_on_one_token_is_what_its_pool_would_count(k_base):
    """The fast path (allocmoe's router, and the vLLM plugin's one-token requests) skips the pool."""
    probs = table(num_tokens=1)
    _, cand_probs = candidates(probs, probs, 4)
    one = torch.ones(1, dtype=torch.bool)
    for k in (1.0, 1.4, 1.5, 2.5, 3.49, 4.0):
        assert static_k(AllocT(k, k_base=k_base), one) == int(AllocT(k, k_base=k_base).counts(cand_probs, one, 1))


def test_choose_keeps_each_prefix_policy_s_prefix():
    cand_probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.9, 0.05, 0.03, 0.02], [0.3, 0.3, 0.2, 0.2]])
    cand_idx = torch.tensor([[3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0]])
    valid = torch.ones(3, dtype=torch.bool)
    expected = {TopP(0.75): [2, 1, 3], NaeeSkip(0.5): [2, 1, 4], StaticTopK(2): [2, 2, 2]}   # counted by hand
    for policy, counts in expected.items():
        choice = choose(policy, cand_idx, cand_probs, cand_probs, valid, 1, 4)
        assert choice.counts.tolist() == counts
        assert choice.keep.tolist() == [[j < c for j in range(4)] for c in counts]
        assert torch.equal(choice.index, cand_idx) and choice.outside is None and choice.distinct is None
    narrow = choose(StaticTopK(2), cand_idx, cand_probs, cand_probs, valid, 1, 2)
    assert narrow.index.shape == (3, 2) and bool(narrow.keep.all())


def test_choose_alloc_t_pools_per_decode_step_when_asked():
    probs = table(num_tokens=6)                                        # [B=2, S=3]
    cand_idx, cand_probs = candidates(probs, probs, 4)
    valid = torch.ones(6, dtype=torch.bool)
    policy = AllocT(2.5)
    stepwise = choose(policy, cand_idx, cand_probs, probs, valid, 2, 4, decode_steps=True).counts
    for s in range(3):                                                 # step s: token s of each row
        tokens = torch.tensor([s, 3 + s])
        alone = policy.counts(cand_probs[tokens], valid[tokens], 2)
        assert stepwise[tokens].tolist() == alone.tolist()
    whole = choose(policy, cand_idx, cand_probs, probs, valid, 2, 4).counts
    assert int(whole.sum()) == 15                                      # one pool: round(2.5 * 6)


def test_choose_distinct_routes_its_real_tokens_and_counts_each_step():
    probs = table(num_tokens=4)
    cand_idx, cand_probs = candidates(probs, probs, 4)
    valid = torch.tensor([True, True, True, False])
    choice = choose(DistinctExperts(3), cand_idx, cand_probs, probs, valid, 4, 4)    # one step of 4
    assert torch.equal(choice.routed, valid) and torch.equal(choice.counts, choice.keep.sum(-1))
    kept = {int(e) for t in range(3) for e in choice.index[t][choice.keep[t]]}
    assert choice.distinct.tolist() == [len(kept)] and len(kept) <= 3
    assert not bool(choice.keep[3].any())                              # padding keeps nothing


def test_row_tokens_are_the_rows_positions():
    assert row_tokens([0, 2], 3, "cpu").tolist() == [0, 1, 2, 6, 7, 8]


def test_choose_rows_lets_each_plan_choose_for_its_rows_alone():
    probs = table(num_tokens=8)                                        # [B=4, S=2]
    cand_idx, cand_probs = candidates(probs, probs, 4)
    valid = torch.ones(8, dtype=torch.bool)
    policies = [AllocT(2.5), TopP(0.6), DistinctExperts(2)]
    groups = {0: [0, 3], 1: [1], 2: [2]}
    mixed = choose_rows(policies, groups, cand_idx, cand_probs, probs, valid, 4)
    for plan_index, rows in groups.items():
        tokens = torch.tensor([2 * r + s for r in rows for s in range(2)])
        alone = choose(policies[plan_index], cand_idx[tokens], cand_probs[tokens], probs[tokens], valid[tokens],
                       len(rows), 4)
        assert torch.equal(mixed.counts[tokens], alone.counts)
        assert torch.equal(mixed.keep[tokens], alone.keep) and torch.equal(mixed.index[tokens], alone.index)
    assert mixed.routed.tolist() == [t in (4, 5) for t in range(8)]   # only the distinct plan's row
    assert mixed.distinct is None                                      # steps are shared by several plans


def test_kept_first_puts_the_kept_candidates_first_in_rank_order():
    keep = torch.tensor([[False, True, False, True], [True, True, False, False]])
    assert kept_first_order(keep).tolist() == [[1, 3, 0, 2], [0, 1, 2, 3]]
    probs = table(num_tokens=2)
    cand_idx, cand_probs = candidates(probs, probs, 4)
    index = cand_idx.clone()
    index[0, 0] = cand_idx[0, 0] + 1 if int(cand_idx[0, 0]) + 1 not in cand_idx[0].tolist() else 7   # a fallback
    seen_idx, seen_probs = kept_first(index, keep, cand_idx, cand_probs, probs)
    assert seen_idx[0].tolist() == [int(index[0, i]) for i in (1, 3, 0, 2)]
    assert float(seen_probs[0, 2]) == float(probs[0, index[0, 0]])   # the fallback's own probability


# -- weigh -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def layer():
    """qwen3_moe (softmax, then top-k, renormalised over the kept): its adapter, first MoE layer, scores."""
    torch.manual_seed(0)
    model = build_tiny("qwen3_moe")
    adapter = adapter_for_model(model)
    moe = adapter.moe_layers(model)[0]
    hidden = torch.randn(6, model.config.hidden_size)                                    # [T, H]
    with torch.no_grad():
        scores = adapter.score(moe.router, hidden)
    offset = torch.randn(adapter.num_experts(), model.config.hidden_size)              # [E, H]
    return adapter, moe.router, scores, hidden, LayerSubstitute(offset=offset)


def renormalised(probs: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    picked = probs.gather(-1, ids) * keep
    return picked / picked.sum(-1, keepdim=True)


def stand_ins_by_loop(probs, cand_idx, kept_slots: list[list[int]], offset) -> torch.Tensor:
    """sum over each token's skipped candidates of (its full-K weight) x (its stand-in, offset[e])."""
    full = renormalised(probs, cand_idx, torch.ones_like(cand_idx, dtype=torch.bool))
    out = torch.zeros(cand_idx.size(0), offset.size(1))
    for t in range(cand_idx.size(0)):
        for j in range(cand_idx.size(1)):
            if j not in kept_slots[t]:
                out[t] += full[t, j] * offset[cand_idx[t, j]]
    return out


def test_static_route_keeps_the_top_k_and_adds_stand_ins_for_the_rest(layer):
    adapter, router, scores, hidden, stand_ins = layer
    k_orig = adapter.k_orig()
    cand_idx = scores.probs.topk(k_orig, dim=-1).indices
    with torch.no_grad():
        index, weights, extra = static_route(adapter, router, scores, 2, k_orig, None, None, hidden)
        assert extra is None and torch.equal(index, cand_idx[:, :2])
        torch.testing.assert_close(weights, renormalised(scores.probs, index, torch.ones_like(index, dtype=torch.bool)))
        index, weights, extra = static_route(adapter, router, scores, 2, k_orig, None, stand_ins, hidden)
    full = renormalised(scores.probs, cand_idx, torch.ones_like(cand_idx, dtype=torch.bool))
    torch.testing.assert_close(weights, full[:, :2])                              # kept at their full-K weights
    torch.testing.assert_close(extra, stand_ins_by_loop(scores.probs, cand_idx, [[0, 1]] * 6, stand_ins.offset))


def test_weigh_combines_the_kept_or_adds_stand_ins(layer):
    adapter, router, scores, hidden, stand_ins = layer
    cand_idx = scores.probs.topk(adapter.k_orig(), dim=-1).indices
    counts = torch.tensor([1, 2, 3, 4, 1, 2])
    keep = torch.arange(4)[None, :] < counts[:, None]
    choice = Choice(cand_idx, keep, counts)
    with torch.no_grad():
        weights, extra = weigh(adapter, router, scores, cand_idx, choice, None, None, hidden)
        assert extra is None
        torch.testing.assert_close(weights, renormalised(scores.probs, cand_idx, keep))
        weights, extra = weigh(adapter, router, scores, cand_idx, choice, None, stand_ins, hidden)
    full = renormalised(scores.probs, cand_idx, torch.ones_like(keep))
    torch.testing.assert_close(weights, full * keep)
    kept_slots = [list(range(int(c))) for c in counts]
    torch.testing.assert_close(extra, stand_ins_by_loop(scores.probs, cand_idx, kept_slots, stand_ins.offset))


def test_weigh_rows_adds_stand_ins_only_on_the_rows_of_plans_that_have_them(layer):
    adapter, router, scores, hidden, stand_ins = layer
    cand_idx = scores.probs.topk(adapter.k_orig(), dim=-1).indices
    counts = torch.tensor([1, 2, 3, 1, 2, 3])
    keep = torch.arange(4)[None, :] < counts[:, None]
    choice = Choice(cand_idx, keep, counts)
    groups = {0: [0, 2], 1: [1]}                                                   # [B=3, S=2]; plan 0 has stand-ins
    with torch.no_grad():
        weights, extra = weigh_rows(adapter, router, scores, cand_idx, choice, None, [stand_ins, None], groups,
                                    hidden, 3)
        none, no_extra = weigh_rows(adapter, router, scores, cand_idx, choice, None, [None, None], groups, hidden, 3)
    assert no_extra is None
    torch.testing.assert_close(none, renormalised(scores.probs, cand_idx, keep))
    full = renormalised(scores.probs, cand_idx, torch.ones_like(keep))
    by_loop = stand_ins_by_loop(scores.probs, cand_idx, [list(range(int(c))) for c in counts], stand_ins.offset)
    plan0, plan1 = [0, 1, 4, 5], [2, 3]
    torch.testing.assert_close(weights[plan0], (full * keep)[plan0])
    torch.testing.assert_close(weights[plan1], none[plan1])
    torch.testing.assert_close(extra[plan0], by_loop[plan0])
    assert (extra[plan1] == 0).all()


# -- count -----------------------------------------------------------------------------------------
def test_count_adds_activations_real_tokens_steps_and_rows():
    ctx = RoutingContext(batch_size=2, track_rows=True, count_steps=True)
    stats = LayerStats()
    index = torch.tensor([[0, 1], [2, 8], [0, 3], [1, 8]])                        # [B=2, S=2]; E = 8 is dropped
    counts, valid = torch.tensor([2, 1, 2, 1]), torch.tensor([True, True, True, False])
    count(stats, ctx, Choice(index, index < 8, counts), index, valid, 8)
    assert int(stats.activations) == 5 and int(stats.tokens) == 3
    # step 0: tokens 0 and 2 load {0, 1, 3}; step 1: token 1 alone (token 3 is padding) loads {2}
    assert int(stats.steps) == 2 and int(stats.distinct) == 4 and int(stats.distinct_max) == 3
    assert ctx.row_activations.tolist() == [3, 2]


def test_count_static_adds_k_per_real_token():
    ctx = RoutingContext(batch_size=1, track_rows=True)
    stats = LayerStats()
    valid = torch.tensor([True, False, True])
    count_static(stats, ctx, 3, torch.zeros(3, 3, dtype=torch.long), valid, 8)
    assert int(stats.activations) == 6 and int(stats.tokens) == 2 and stats.steps == 0
    assert ctx.row_activations.tolist() == [6]


def test_record_hands_recorders_the_ranking_or_the_kept_first():
    probs = table(num_tokens=3)
    cand_idx, cand_probs = candidates(probs, probs, 4)
    valid = torch.ones(3, dtype=torch.bool)
    seen = []
    prefix = choose(TopP(0.5), cand_idx, cand_probs, probs, valid, 1, 4)
    record([lambda *args: seen.append(args)], 5, prefix, cand_idx, cand_probs, probs, valid)
    layer_index, idx, p, counts, _ = seen.pop()
    assert layer_index == 5 and idx is cand_idx and p is cand_probs and counts is prefix.counts
    distinct = choose(DistinctExperts(2), cand_idx, cand_probs, probs, valid, 3, 4)
    record([lambda *args: seen.append(args)], 5, distinct, cand_idx, cand_probs, probs, valid)
    _, idx, _, counts, _ = seen.pop()
    for t in range(3):                                                             # its first counts[t] are the kept
        assert sorted(idx[t, :counts[t]].tolist()) == sorted(distinct.index[t][distinct.keep[t]].tolist())
