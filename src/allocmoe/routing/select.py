"""Selection: which of its top-K candidates each token keeps, given a layer's scores and policies.

The pieces a router runs before it weighs anything, shared by allocmoe's own router (routing/router.py)
and the vLLM plugin's (integrations/vllm_routing.py), so both choose by the same code:

  candidates   scores -> each token's ranked top-K (ids and non-increasing probabilities)
  static_k     the k every token gets when a policy cannot vary it (the router's fast path)
  choose       one policy over a pass (or a part of one): ids, keep, counts (+ distinct's extras)
  choose_rows  mixed plans: each plan's policy over its own batch rows, as if they were the batch
  kept_first   a selection reordered so each token's kept candidates come first

Pure torch over tensors; no model, no engine. Shape legend: T = tokens in the pass, E = routed
experts, K = K_orig (the model's top-k), W = width of a selection (<= K), B = rows (sequences) in
the batch, S = positions per row (T = B * S), also the decode steps of a [B, S] pass.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from ..core.policies import AllocT, DistinctExperts, Policy, StaticTopK, expected_alloc_t_activations, prefix_mask, \
    step_count


class Choice(NamedTuple):
    """What a policy chose over a pass. Prefix policies keep the first counts[t] of each token's
    ranking; the distinct policy may keep any of its candidates and also says which tokens' top-1
    fell outside the step's chosen set and how many experts each step loads."""
    index: torch.Tensor                        # [T, W] expert ids (distinct: slot 0 may be a fallback)
    keep: torch.Tensor                         # [T, W] bool, the kept slots
    counts: torch.Tensor                       # [T] kept slots per token
    outside: torch.Tensor | None = None        # [T] distinct: real tokens whose own top-1 was not chosen
    routed: torch.Tensor | None = None         # [T] distinct: the real tokens it routed (outside's denominator)
    distinct: torch.Tensor | None = None       # [S] distinct, one policy over the pass: experts each step loads


def candidates(ranking: torch.Tensor, probs: torch.Tensor, k_orig: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ranking, probs [T, E] -> (cand_idx [T, K] best first, cand_probs [T, K] non-increasing).

    cand_probs are the candidates' probabilities made non-increasing along the ranking (a family may
    rank by another key, as DeepSeek-V3's bias does), so every prefix policy's choice is a prefix."""
    top = ranking.topk(k_orig, dim=-1)
    if ranking is probs:                                             # ranked by probability: already sorted
        return top.indices, top.values                              # [T, K], [T, K]
    return top.indices, probs.gather(-1, top.indices).cummin(-1).values


def static_k(policy: Policy, valid: torch.Tensor) -> int | None:
    """The k every token gets when the policy cannot vary it: static top-k, or Alloc-T on a single
    real token (decode of one sequence), where the pool rule gives k_base + round_half_up(k - k_base).
    valid [T]."""
    if isinstance(policy, StaticTopK):
        return policy.k
    if isinstance(policy, AllocT) and valid.numel() == 1 and bool(valid[0]):
        return expected_alloc_t_activations(policy.k, policy.k_base, 1)
    return None


def per_step_counts(policy: AllocT, cand_probs: torch.Tensor, valid: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Alloc-T counts [T] as batched decoding makes them: each step (column) of the [B, S] pass is a
    pass of its own, pooling its B tokens (pool "batch") or each token alone (pool "sequence").
    cand_probs [T, K], valid [T]."""
    num_tokens = cand_probs.size(0)
    num_steps = step_count(num_tokens, batch_size)
    if num_steps == 1 or num_tokens % num_steps:
        return policy.counts(cand_probs, valid, batch_size)
    order = torch.arange(num_tokens, device=valid.device).view(-1, num_steps).t().reshape(-1)   # [T] step-major
    pools = num_steps if policy.pool == "batch" else num_tokens
    counts = torch.empty(num_tokens, dtype=torch.long, device=valid.device)
    counts[order] = replace(policy, pool="sequence").counts(cand_probs[order], valid[order], pools)
    return counts


def choose(policy: Policy, cand_idx: torch.Tensor, cand_probs: torch.Tensor, probs: torch.Tensor,
           valid: torch.Tensor, batch_size: int, width: int, decode_steps: bool = False) -> Choice:
    """One policy over a pass of `batch_size` rows: cand_idx, cand_probs [T, K], probs [T, E], valid
    [T] -> Choice. Prefix policies keep the first counts[t] of cand_idx[:, :width] (index, keep
    [T, width]); distinct returns its own index and keep [T, K], `outside`, `routed` (= valid) and
    the experts each step loads. `decode_steps`: Alloc-T pools per decode step (per_step_counts)."""
    if isinstance(policy, DistinctExperts):
        index, keep, outside, distinct = policy.select(cand_idx, cand_probs, probs, valid, batch_size)
        return Choice(index, keep, keep.sum(-1), outside, valid, distinct)
    if decode_steps and isinstance(policy, AllocT):
        counts = per_step_counts(policy, cand_probs, valid, batch_size)
    else:
        counts = policy.counts(cand_probs, valid, batch_size)                          # [T]
    return Choice(cand_idx[:, :width], prefix_mask(counts, width), counts)


def row_tokens(rows: list[int], per_row: int, device) -> torch.Tensor:
    """The token positions [len(rows) * S] of batch rows `rows` in a flattened [B, S] pass."""
    row_idx = torch.tensor(rows, device=device)
    return (row_idx[:, None] * per_row + torch.arange(per_row, device=device)).reshape(-1)


def choose_rows(policies: list[Policy], groups: dict[int, list[int]], cand_idx: torch.Tensor,
                cand_probs: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor, batch_size: int,
                decode_steps: bool = False) -> Choice:
    """Rows that follow different plans: `groups` maps plan index -> its batch rows, and each plan's
    policy (`policies[plan index]`) decides for its own rows alone, as if they had been the batch
    (its rows' tokens are its whole pool, or its steps' tokens). -> Choice of width K, with
    `outside` and `routed` set where a distinct policy ran (no per-step count: steps are shared)."""
    num_tokens, k_orig = cand_idx.shape
    index, keep = cand_idx.clone(), torch.zeros_like(cand_idx, dtype=torch.bool)   # [T, K]
    counts = torch.empty(valid.shape, dtype=torch.long, device=valid.device)        # [T]
    outside = routed = None
    per_row = num_tokens // batch_size                                              # S
    for plan_index, rows in groups.items():
        tokens = row_tokens(rows, per_row, valid.device)                               # [b*S]
        part = choose(policies[plan_index], cand_idx[tokens], cand_probs[tokens], probs[tokens], valid[tokens],
                      len(rows), k_orig, decode_steps)
        index[tokens], keep[tokens], counts[tokens] = part.index, part.keep, part.counts
        if part.outside is not None:
            if outside is None:
                outside, routed = torch.zeros_like(valid), torch.zeros_like(valid)
            outside[tokens], routed[tokens] = part.outside, valid[tokens]
    return Choice(index, keep, counts, outside, routed)


def kept_first_order(keep: torch.Tensor) -> torch.Tensor:
    """keep [T, W] -> order [T, W]: each row's kept slots first, then the dropped, each in slot order."""
    return (~keep).to(torch.int8).argsort(dim=-1, stable=True)


def kept_first(index: torch.Tensor, keep: torch.Tensor, cand_idx: torch.Tensor, cand_probs: torch.Tensor,
               probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What recorders see of a selection that need not be a prefix (index, keep [T, K]): each token's
    candidates with the kept ones first (in rank order), so its first counts[t] are what it keeps,
    and their probabilities (probs [T, E]; a fallback expert's own). -> [T, K], [T, K]."""
    order = kept_first_order(keep)                                                  # [T, K] kept first
    own = torch.where(index == cand_idx, cand_probs, probs.gather(-1, index).to(cand_probs.dtype))
    return index.gather(-1, order), own.gather(-1, order)
