"""DeepSeek-V2 (softmax, greedy or group-limited top-k, times routed_scaling_factor, no renormalising)
and DeepSeek-V3 (sigmoid scores; choice on score + e_score_correction_bias within the top groups;
weights are the unbiased scores, renormalised if norm_topk_prob, times routed_scaling_factor).
Shared experts sit beside the router and are untouched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MoEAdapter, RouterScores
from .registry import register_adapter


def _mask_to_groups(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """-inf outside each token's `topk_group` best groups. choice [T, E], group_scores [T, G]."""
    num_tokens, num_groups = group_scores.shape
    best = group_scores.topk(topk_group, dim=-1).indices                     # [T, topk_group]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)   # [T, G]
    allowed = allowed.repeat_interleave(choice.size(-1) // num_groups, dim=-1)           # [T, E]
    return choice.masked_fill(~allowed, float("-inf"))


@register_adapter
class DeepseekV2Adapter(MoEAdapter):
    model_types = ("deepseek_v2",)

    def score(self, router, hidden: torch.Tensor) -> RouterScores:
        logits = F.linear(hidden.float(), router.weight.float())              # [T, E]
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        ranking = probs
        if router.topk_method == "group_limited_greedy":
            groups = probs.view(probs.size(0), router.num_group, -1).max(dim=-1).values  # [T, G]
            ranking = _mask_to_groups(probs, groups, router.topk_group)
        return RouterScores(logits=logits, ranking=ranking, probs=probs, gates=probs * router.routed_scaling_factor)


@register_adapter
class DeepseekV3Adapter(MoEAdapter):
    model_types = ("deepseek_v3",)

    @property
    def renormalizes(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.config, "norm_topk_prob", False))

    def score(self, router, hidden: torch.Tensor) -> RouterScores:
        logits = F.linear(hidden.float(), router.weight.float())              # [T, E]
        sig = logits.sigmoid()
        choice = sig + router.e_score_correction_bias
        groups = choice.view(choice.size(0), router.num_group, -1).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        ranking = _mask_to_groups(choice, groups, router.topk_group)
        probs = sig / sig.sum(-1, keepdim=True)
        return RouterScores(logits=logits, ranking=ranking, probs=probs, gates=sig)

    def combine(self, router, scores, index, keep, renormalize=None):
        weights = scores.gates.gather(-1, index) * keep                       # [T, W]
        if self.renormalizes if renormalize is None else renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
