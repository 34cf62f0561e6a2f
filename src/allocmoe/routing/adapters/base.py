"""What an adapter is: how one model family routes, restated so any policy can drive it.

An adapter finds a family's MoE blocks and splits its router into two steps:
  score(router, h)                 -> RouterScores: the logits the router natively returns, the key
                                      it ranks experts by (-inf where it forbids them), and a
                                      probability per expert for thresholds and the Alloc-T pool;
  combine(router, scores, idx, keep) -> the weights the family gives the selected experts.
At K_orig with every token keeping its top-K_orig, score + combine reproduce the native router.

Shape legend: T = tokens, E = routed experts, H = hidden size, W = selected slots per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RouterScores:
    logits: torch.Tensor    # [T, E] what the native router returns first (recorded for aux losses)
    ranking: torch.Tensor   # [T, E] the native choice key; -inf for experts the router may not pick
    probs: torch.Tensor     # [T, E] a distribution over experts: used by top-p, NAEE and the Alloc-T pool
    gates: torch.Tensor     # [T, E] the per-expert values the family's combine starts from


@dataclass
class MoELayer:
    index: int              # the decoder layer's index in the model (plan files key layers by it)
    block: nn.Module        # the sparse MoE block
    router: nn.Module
    experts: nn.Module


class MoEAdapter:
    """Base adapter: the common layout `model.model.layers[i].<block_attr>.{<router_attr>, experts}`."""

    model_types: tuple[str, ...] = ()
    block_attrs: tuple[str, ...] = ("mlp",)
    router_attr: str = "gate"
    renormalizes: bool = False      # does the native combine renormalise the selected weights?

    def __init__(self, config):
        self.config = config

    # -- facts about the model -------------------------------------------------------------
    def num_experts(self) -> int:
        c = self.config
        for name in ("num_experts", "num_local_experts", "n_routed_experts"):
            if getattr(c, name, None):
                return int(getattr(c, name))
        raise ValueError("config names no expert count")

    def k_orig(self) -> int:
        return int(self.config.num_experts_per_tok)

    def moe_layers(self, model: nn.Module) -> list[MoELayer]:
        base = model.model if hasattr(model, "model") else model
        found = []
        for index, layer in enumerate(base.layers):
            for attr in self.block_attrs:
                block = getattr(layer, attr, None)
                if block is not None and hasattr(block, "experts") and hasattr(block, self.router_attr):
                    found.append(MoELayer(index, block, getattr(block, self.router_attr), block.experts))
                    break
        return found

    # -- routing, restated -----------------------------------------------------------------
    def score(self, router: nn.Module, hidden: torch.Tensor) -> RouterScores:
        raise NotImplementedError

    def combine(self, router: nn.Module, scores: RouterScores, index: torch.Tensor, keep: torch.Tensor,
                renormalize: bool | None = None) -> torch.Tensor:
        """Weights [T, W] for experts `index` [T, W] where `keep` [T, W]; 0 elsewhere.
        `renormalize` None follows the family; True/False overrides it."""
        weights = scores.gates.gather(-1, index) * keep                       # [T, W]
        if self.renormalizes if renormalize is None else renormalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights


def softmax_scores(logits: torch.Tensor) -> RouterScores:
    """The common case: rank by, threshold on, and combine with the softmax probabilities."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)                  # [T, E]
    return RouterScores(logits=logits, ranking=probs, probs=probs, gates=probs)
