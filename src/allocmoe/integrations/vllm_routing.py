"""A vLLM step's expert selection under allocmoe plans: which (token, expert) pairs each request keeps.

vLLM hands a MoE layer's router the step's logits for every scheduled token, requests side by side
(`segments`: first token, end, plan index). This module restates the served router (read from the
vLLM router's own settings: softmax or sigmoid scores, a score correction bias, grouped top-k,
renormalising, the routed scaling factor), lets each request's policy choose from its tokens' top-K
candidates by allocmoe's own selection (routing/select.py: `candidates`, `static_k`, `choose`, `kept_first_order`,
the pieces allocmoe's router runs; the rules are core/policies.py's), and returns the kept pairs
kept-first, so that `counts[t]` says how many of row t's slots are real:

    ids     [T, W]  expert ids, the kept ones first; a dropped slot repeats the row's first id
    weights [T, W]  the kernel's weights, 0 on dropped slots
    counts  [T]     kept slots per token (0..K)

Shape legend: T = tokens in the step, E = routed experts, K = the model's top-k, W = widest count,
G = expert groups (DeepSeek), D = decode tokens of one plan in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.policies import DistinctExperts, Policy
from ..errors import AllocMoeError
from ..routing.select import candidates, choose, kept_first_order, static_k

Segment = tuple[int, int, int]          # (first token, end, plan index) of one request in the step
_ONE_REAL = torch.ones(1, dtype=torch.bool)     # valid [1] of a decode request: made once, not per request and layer


@dataclass(frozen=True)
class RouterSpec:
    """What allocmoe needs to know of a vLLM router to restate it."""
    k_orig: int                               # K: experts per token in the unmodified model
    scoring: str                              # "softmax" or "sigmoid": how logits become scores
    renormalize: bool                         # kept weights divided by their sum (norm_topk_prob)
    scaling: float = 1.0                      # routed_scaling_factor, applied to the weights
    bias: torch.Tensor | None = None          # [E] e_score_correction_bias: steers the choice, not the weights
    groups: tuple[int, int] | None = None     # (num_expert_group, topk_group) for grouped top-k

    @classmethod
    def of(cls, router, k_orig: int, layer: int) -> "RouterSpec":
        if getattr(router, "custom_routing_function", None) is not None or \
                getattr(router, "scoring_func", "softmax") not in ("softmax", "sigmoid"):
            raise AllocMoeError(f"allocmoe vLLM plugin: layer {layer} routes with a custom function or "
                                f"{getattr(router, 'scoring_func', None)!r} scores, which the plugin cannot restate; "
                                "serve a single static per-layer plan instead (it only narrows vLLM's own top-k)")
        groups = None
        if getattr(router, "use_grouped_topk", False):
            groups = (int(router.num_expert_group or 1), int(router.topk_group or 1))
        return cls(k_orig, router.scoring_func, bool(router.renormalize),
                   float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
                   getattr(router, "e_score_correction_bias", None), groups)

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [T, E] -> (ranking [T, E]: -inf outside the chosen groups, probs [T, E]: what the
        policies threshold on, gates [T, E]: what the weights are made of)."""
        logits = logits.float()
        if self.scoring == "softmax":
            gates = probs = logits.softmax(-1)
        else:
            gates = logits.sigmoid()
            probs = gates / gates.sum(-1, keepdim=True)
        choice = gates if self.bias is None else gates + self.bias.float()
        if self.groups is None or self.groups[0] <= 1:
            return choice, probs, gates
        num_groups, topk_group = self.groups
        per_group = choice.view(choice.size(0), num_groups, -1)                          # [T, G, E/G]
        group_scores = per_group.topk(2, -1)[0].sum(-1) if self.bias is not None else per_group.max(-1).values
        best = group_scores.topk(topk_group, dim=-1).indices                             # [T, topk_group]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        allowed = allowed.repeat_interleave(choice.size(-1) // num_groups, dim=-1)       # [T, E]
        return choice.masked_fill(~allowed, float("-inf")), probs, gates

    def weights(self, gates: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor,
                norm_keep: torch.Tensor) -> torch.Tensor:
        """[T, W] kernel weights of `ids` where `keep`, normalised (if the router renormalises) over the
        slots `norm_keep` marks: the kept ones, or all K candidates for a plan with stand-ins."""
        picked = gates.gather(-1, ids.long())
        weights = picked * keep
        if self.renormalize:
            weights = weights / (picked * norm_keep).sum(-1, keepdim=True).clamp_min(1e-20)
        return weights * self.scaling if self.scaling != 1.0 else weights


@dataclass
class Selection:
    ids: torch.Tensor                         # [T, W] int32, kept first
    weights: torch.Tensor                     # [T, W] float32, 0 where dropped
    counts: torch.Tensor                      # [T] kept slots
    skipped_ids: torch.Tensor | None = None   # [T, K] candidates a stand-in replaces (rows of plans with means)
    skipped_weights: torch.Tensor | None = None   # [T, K] their full-K weights, 0 where kept or no stand-in
    loaded: list[int] | None = None           # distinct experts of each decode step (distinct plans), for stats


def select(spec: RouterSpec, logits: torch.Tensor, segments: list[Segment], policies: list[Policy],
           with_means: list[bool]) -> Selection:
    """Each request's tokens choose by their plan's policy (`policies[plan index]`); Alloc-T pools
    over the request's tokens in the step. `with_means[i]`: plan i adds stand-ins for what it skips."""
    ranking, probs, gates = spec.scores(logits)                              # [T, E] each
    cand_idx, cand_probs = candidates(ranking, probs, spec.k_orig)           # [T, K] best first, non-increasing
    num_tokens, k_orig = cand_idx.shape
    index, keep = cand_idx.clone(), torch.zeros_like(cand_idx, dtype=torch.bool)
    loaded: list[int] | None = None
    for plan_index, spans in _by_plan(segments).items():
        policy = policies[plan_index]
        if isinstance(policy, DistinctExperts):
            loaded = (loaded or []) + _choose_distinct(policy, spans, cand_idx, cand_probs, probs, index, keep)
            continue
        for start, end in spans:                                             # one request: its own pool
            _choose(policy, slice(start, end), end - start, cand_idx, cand_probs, probs, index, keep, batch_size=1)
    order = kept_first_order(keep)                                           # [T, K] kept first, in rank order
    index, keep = index.gather(-1, order), keep.gather(-1, order)
    counts = keep.sum(-1)                                                    # [T]
    width = max(int(counts.max()), 1) if num_tokens else 1
    means_rows = _rows(segments, with_means, num_tokens)                     # [T] rows whose plan has stand-ins
    norm_keep = keep | means_rows[:, None]
    weights = spec.weights(gates, index, keep, norm_keep)                    # [T, K]
    selection = Selection(index[:, :width].to(torch.int32), weights[:, :width].contiguous(), counts, loaded=loaded)
    selection.ids = torch.where(keep[:, :width], selection.ids, selection.ids[:, :1]).contiguous()
    if bool(means_rows.any()):
        skipped = ~keep & means_rows[:, None]                                # [T, K]
        selection.skipped_ids = index
        selection.skipped_weights = spec.weights(gates, index, skipped, norm_keep)
    return selection


def _by_plan(segments: list[Segment]) -> dict[int, list[tuple[int, int]]]:
    groups: dict[int, list[tuple[int, int]]] = {}
    for start, end, plan_index in segments:
        if end > start:
            groups.setdefault(plan_index, []).append((start, end))
    return groups


def _rows(segments: list[Segment], flags: list[bool], num_tokens: int) -> torch.Tensor:
    rows = torch.zeros(num_tokens, dtype=torch.bool)
    for start, end, plan_index in segments:
        if flags[plan_index]:
            rows[start:end] = True
    return rows


def _choose_distinct(policy: DistinctExperts, spans: list[tuple[int, int]], cand_idx: torch.Tensor,
                     cand_probs: torch.Tensor, probs: torch.Tensor, index: torch.Tensor,
                     keep: torch.Tensor) -> list[int]:
    """The distinct policy over one plan's requests: their decode tokens (one per request) form one
    step whose experts are capped at M; a prompt's tokens are each a step of their own, as in
    allocmoe's server. Writes the choice into index/keep [T, K]; returns the decode step's loaded count."""
    decode = torch.tensor([start for start, end in spans if end - start == 1], dtype=torch.long)   # [D]
    loaded = []
    if decode.numel():
        _choose(policy, decode, decode.numel(), cand_idx, cand_probs, probs, index, keep, batch_size=decode.numel())
        loaded.append(int(torch.unique(index[decode][keep[decode]]).numel()))
    for start, end in spans:
        if end - start > 1 and policy.max_experts >= cand_idx.size(1):   # a one-token step fits M: all K kept
            keep[start:end] = True
        elif end - start > 1:
            _choose(policy, slice(start, end), end - start, cand_idx, cand_probs, probs, index, keep, batch_size=1)
    return loaded


def _choose(policy: Policy, rows, num_rows: int, cand_idx: torch.Tensor, cand_probs: torch.Tensor,
            probs: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, batch_size: int) -> None:
    """`policy` over the tokens `rows` (a slice or positions, num_rows of them, all real) as a pass of
    `batch_size` sequences, by allocmoe's own selection (routing/select.py: one k for every token
    where the policy cannot vary it, as allocmoe's router's fast path, else `choose`); writes the
    choice into index / keep [T, K] (index only where the policy may keep a non-prefix: distinct)."""
    valid = _ONE_REAL if num_rows == 1 else torch.ones(num_rows, dtype=torch.bool)      # [rows], read only
    k = static_k(policy, valid)
    if k is not None:
        keep[rows, :k] = True
        return
    part = choose(policy, cand_idx[rows], cand_probs[rows], probs[rows], valid, batch_size, cand_idx.size(1))
    keep[rows] = part.keep
    if isinstance(policy, DistinctExperts):
        index[rows] = part.index


def all_full(selection: Selection, k_orig: int) -> bool:
    """Every token keeps its top-K and nothing is added: vLLM's own routing gives the same."""
    return selection.skipped_ids is None and bool((selection.counts == k_orig).all())

