"""Top-k-on-logits-then-softmax families: GPT-OSS (router with bias, block attribute `router`) and
GraniteMoE / GraniteMoE-Shared (block `block_sparse_moe`, attribute `router`). The combine is a
softmax over the selected logits, so it always renormalises over what is kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MoEAdapter, RouterScores
from .registry import register_adapter


@register_adapter
class GptOssAdapter(MoEAdapter):
    model_types = ("gpt_oss",)
    router_attr = "router"
    renormalizes = True

    def score(self, router, hidden: torch.Tensor) -> RouterScores:
        logits = F.linear(hidden, router.weight, getattr(router, "bias", None))   # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        return RouterScores(logits=logits, ranking=logits, probs=probs, gates=logits)

    def combine(self, router, scores, index, keep, renormalize=None):
        picked = scores.gates.gather(-1, index)                               # [T, W] logits
        if renormalize is False:                                              # raw probabilities instead
            return scores.probs.gather(-1, index) * keep
        weights = torch.softmax(picked.masked_fill(~keep, float("-inf")), dim=-1, dtype=picked.dtype)
        return torch.nan_to_num(weights) * keep                               # rows with nothing kept -> 0


@register_adapter
class GraniteMoeAdapter(GptOssAdapter):
    model_types = ("granitemoe", "granitemoeshared")
    block_attrs = ("block_sparse_moe", "mlp")

    def score(self, router, hidden: torch.Tensor) -> RouterScores:
        logits = F.linear(hidden, router.weight).float()                      # [T, E]
        probs = torch.softmax(logits, dim=-1)
        return RouterScores(logits=logits, ranking=logits, probs=probs, gates=logits)
