"""Softmax-then-top-k families: Mixtral (always renormalises), Qwen2-MoE, Qwen3-MoE and OLMoE
(renormalise only if `norm_topk_prob`). Qwen2-MoE's gated shared expert lives outside the router
and is untouched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MoEAdapter, RouterScores, softmax_scores
from .registry import register_adapter


@register_adapter
class SoftmaxTopKAdapter(MoEAdapter):
    model_types = ("qwen2_moe", "qwen3_moe", "olmoe")

    @property
    def renormalizes(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.config, "norm_topk_prob", False))

    def score(self, router, hidden: torch.Tensor) -> RouterScores:
        return softmax_scores(F.linear(hidden, router.weight))                # logits [T, E]


@register_adapter
class MixtralAdapter(SoftmaxTopKAdapter):
    model_types = ("mixtral",)
    renormalizes = True  # type: ignore[assignment]
