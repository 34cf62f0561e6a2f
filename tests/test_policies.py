"""Selection policies against brute-force, per-token reference computations."""

import math

import pytest
import torch

from allocmoe.errors import AllocMoeError
from allocmoe.core.policies import (AllocT, NaeeSkip, StaticTopK, TopP, expected_alloc_t_activations,
                               prefix_mask, select_experts)
from conftest import policy_from_layer_entry


def sorted_probs(num_tokens, k_orig=6, num_experts=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.randn(num_tokens, num_experts, generator=gen).mul(2).softmax(-1)
    return probs, probs.topk(k_orig, dim=-1).values


@pytest.mark.parametrize("num_tokens,k,k_base", [(7, 2.5, 1), (16, 3, 1), (33, 1.7, 0), (10, 4.2, 2), (5, 6, 1)])
def test_alloc_t_spends_exactly_the_rounded_budget_on_the_best_pool_entries(num_tokens, k, k_base):
    _, cand = sorted_probs(num_tokens)
    valid = torch.ones(num_tokens, dtype=torch.bool)
    counts = AllocT(k, k_base).counts(cand, valid, 1)
    assert int(counts.sum()) == math.floor(k * num_tokens + 0.5) == expected_alloc_t_activations(k, k_base, num_tokens)
    assert counts.min() >= k_base and counts.max() <= cand.size(1)
    # optimality: the chosen extras carry the largest pool scores (brute force over the sorted pool)
    extra = int(counts.sum()) - k_base * num_tokens
    pool = sorted((float(v) for row in cand[:, k_base:] for v in row), reverse=True)
    chosen = sum(float(cand[t, j]) for t in range(num_tokens) for j in range(k_base, int(counts[t])))
    assert chosen == pytest.approx(sum(pool[:extra]), rel=1e-6)


def test_alloc_t_with_k_base_equal_to_k_is_static_top_k():
    _, cand = sorted_probs(20)
    valid = torch.ones(20, dtype=torch.bool)
    assert torch.equal(AllocT(3, 3).counts(cand, valid, 1), StaticTopK(3).counts(cand, valid, 1))


def test_alloc_t_excludes_padding_and_can_pool_per_sequence():
    _, cand = sorted_probs(12)
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)   # 2 sequences of 6
    batch_pool = AllocT(2.5, 1).counts(cand, valid, 2)
    assert batch_pool[~valid].eq(0).all()
    assert int(batch_pool.sum()) == math.floor(2.5 * 10 + 0.5)
    per_seq = AllocT(2.5, 1, pool="sequence").counts(cand, valid, 2).view(2, 6)
    assert int(per_seq[0].sum()) == math.floor(2.5 * 6 + 0.5)
    assert int(per_seq[1].sum()) == math.floor(2.5 * 4 + 0.5)


def test_top_p_matches_a_per_token_loop():
    probs, cand = sorted_probs(40, seed=3)
    for p in (0.1, 0.5, 0.8, 0.99):
        counts = TopP(p).counts(cand, torch.ones(40, dtype=torch.bool), 1)
        for t in range(40):
            total, n = 0.0, 0
            while n < cand.size(1) and total < p:
                total += float(cand[t, n])
                n += 1
            assert int(counts[t]) == max(n, 1)


def test_naee_matches_a_per_token_loop():
    _, cand = sorted_probs(40, seed=4)
    for beta in (0.0, 0.3, 0.7, 1.0):
        counts = NaeeSkip(beta).counts(cand, torch.ones(40, dtype=torch.bool), 1)
        for t in range(40):
            n = 1 + sum(1 for j in range(1, cand.size(1)) if cand[t, j] >= beta * cand[t, 0])
            assert int(counts[t]) == n


def test_select_experts_pads_with_the_sentinel_and_keeps_a_prefix_of_each_ranking():
    probs, _ = sorted_probs(9, num_experts=16)
    weights, index = select_experts(probs, AllocT(2.0, 1), k_orig=6)
    ranking = probs.argsort(-1, descending=True)
    for t in range(9):
        kept = [int(i) for i in index[t] if i < 16]
        assert kept == ranking[t, :len(kept)].tolist()
        assert torch.all(weights[t, len(kept):] == 0)
        assert torch.allclose(weights[t, :len(kept)], probs[t, kept])


def test_prefix_mask():
    assert prefix_mask(torch.tensor([0, 2, 3]), 3).tolist() == [[False] * 3, [True, True, False], [True] * 3]


@pytest.mark.parametrize("entry,message", [
    ({"policy": "top-k", "k": 7}, "k 7 is above k_orig 6"),
    ({"policy": "top-k", "k": 0}, "k: Input should be greater than or equal to 1"),
    ({"policy": "top-k", "k": 2.5}, "k: must be a whole number, got 2.5"),
    ({"policy": "top-k", "k": True}, "k: must be a number, got True"),
    ({"policy": "alloc-t", "k": float("nan")}, "k: Input should be a finite number"),
    ({"policy": "alloc-t", "k": 2, "k_base": 3}, "k_base 3 is above k 2"),
    ({"policy": "alloc-t", "k": 2, "k_base": -1}, "k_base"),
    ({"policy": "magic", "k": 2}, "unknown policy 'magic'; known: top-k"),
    ({"policy": "top-k", "k": 2, "colour": 1}, "colour: unknown field"),
    ({"k": 2}, "needs a 'policy' field"),
    ({"policy": "top-p", "p": 1.5}, "p: Input should be less than or equal to 1"),
])
def test_bad_layer_entries_are_refused_with_the_reason(entry, message):
    with pytest.raises(AllocMoeError, match=__import__("re").escape(message)):
        policy_from_layer_entry(entry, k_orig=6)


@pytest.mark.parametrize("policy", [StaticTopK(0), StaticTopK(5), AllocT(k=0), AllocT(k=2, k_base=3),
                                    AllocT(k=2, pool="row"), TopP(p=0.0), NaeeSkip(beta=-1.0)],
                         ids=repr)
def test_a_policy_out_of_range_is_one_line_that_says_how_to_fix_it(policy):
    """A hand-made plan reaches these checks when it is applied: the same one-line form as every refusal."""
    with pytest.raises(AllocMoeError) as exc:
        policy.check(4)
    said = str(exc.value)
    assert "; " in said and "\n" not in said, said
