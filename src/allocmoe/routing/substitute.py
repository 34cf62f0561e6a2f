"""The substitute under a plan: what skipped experts add back, and where it is added.

A plan with means (`plan.means`, core/means.py) keeps its experts at the weights the full model gives
them (for renormalising routers, normalised over the original top-K_orig, not the kept set) and adds,
per token, the sum over its skipped top-K_orig candidates of weight x that expert's stand-in: its
calibrated mean output, plus with a rank-r linear term ((x - input_mean) @ down) @ up. The router's
forward (routing/router.py) computes it and leaves it in the layer's `pending` dict; the experts'
forward here adds it to their output in the same pass.

The stand-in is affine in x, so it is kept folded: offset_e = mean_e - (input_mean_e @ down_e) @ up_e,
and stand_in_e(x) = offset_e + (x @ down_e) @ up_e. Per token that is 2 x H x r multiply-adds per
skipped slot, gathered slot by slot (decode) or grouped by expert (prefill); an expert costs 3 x H x I.

Shape legend: T = tokens, E = routed experts, K = K_orig, W = selected slots, S = skipped slots,
H = hidden size, r = rank of the linear term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.plan import Plan
from ..core.policies import DistinctExperts
from ..errors import AllocMoeError
from .adapters import MoEAdapter, MoELayer
from .experts import compact_experts_forward


@dataclass
class LayerSubstitute:
    """One layer's stand-ins for skipped experts, folded for inference (see the module docstring)."""
    offset: torch.Tensor               # [E, H] mean_e - (input_mean_e @ down_e) @ up_e (the means at rank 0)
    down: torch.Tensor | None = None   # [E, H, r]
    up: torch.Tensor | None = None     # [E, r, H]

    GATHER_MAX = 1 << 22               # means alone: gathered slots' elements up to which the per-slot path runs
    GATHER_MAX_ELEMENTS = 1 << 20      # with a linear term: gathered [pairs, H, r] factors up to which each pair
                                       # gathers its own (decode); at prefill the gathers cost more than the experts

    def dense(self, weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """sum over e of weights[t, e] x stand_in_e(x_t): weights [T, E] (0 where not skipped) -> [T, H]."""
        weights = weights.to(self.offset.dtype)
        if self.down is None:
            return weights @ self.offset
        token_idx, expert_idx = weights.nonzero(as_tuple=True)                                  # [P] skipped pairs
        return self._pairs(token_idx, expert_idx, weights[token_idx, expert_idx], hidden)

    def skipped(self, weights: torch.Tensor, index: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The same over a token's skipped slots: weights, index [T, S] -> [T, H]."""
        num_tokens, slots = index.shape
        weights = weights.to(self.offset.dtype)
        if self.down is None:
            if num_tokens * slots * self.offset.size(-1) <= self.GATHER_MAX:
                return torch.einsum("ts,tsh->th", weights, self.offset[index])
            dense = torch.zeros(num_tokens, self.offset.size(0), dtype=weights.dtype, device=weights.device)
            return dense.scatter_add_(1, index, weights) @ self.offset
        token_idx = torch.arange(num_tokens, device=index.device).repeat_interleave(slots)
        return self._pairs(token_idx, index.reshape(-1), weights.reshape(-1), hidden)

    def _pairs(self, token_idx: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor,
               hidden: torch.Tensor) -> torch.Tensor:
        """sum over pairs p of weights[p] x stand_in_{expert_idx[p]}(x_{token_idx[p]}) -> [T, H]. Up to
        GATHER_MAX_ELEMENTS gathered factor elements (decode: 64 pairs of a DeepSeek-V2-Lite layer,
        1,024 of the built-in model's) each pair gathers its expert's factors; above (prefill) the pairs
        are grouped by expert, [n, H] x [H, r] x [r, H] per expert. Work is proportional to the P
        pairs either way. (Padding the groups into two batched products measured slower on the
        built-in model's prefill, and a dense product over all E experts does E / S times the work.)"""
        hidden = hidden.to(self.offset.dtype)
        out = torch.zeros(hidden.size(0), self.offset.size(-1), dtype=hidden.dtype, device=hidden.device)
        if token_idx.numel() * self.down[0].numel() <= self.GATHER_MAX_ELEMENTS:                # two batched products
            z = torch.bmm(hidden[token_idx].unsqueeze(1), self.down[expert_idx])               # [P, 1, r]
            y = torch.baddbmm(self.offset[expert_idx].unsqueeze(1), z, self.up[expert_idx])    # [P, 1, H]
            return out.index_add_(0, token_idx, y.squeeze(1) * weights[:, None])
        expert_idx, order = torch.sort(expert_idx)
        token_idx, weights = token_idx[order], weights[order]
        x = hidden[token_idx]                                                                  # [P, H]
        y = torch.empty_like(x)
        start = 0
        for e, n in enumerate(torch.bincount(expert_idx, minlength=self.offset.size(0)).tolist()):
            if n:
                y[start:start + n] = x[start:start + n] @ self.down[e] @ self.up[e] + self.offset[e]
                start += n
        return out.index_add_(0, token_idx, y * weights[:, None])


def substituted(adapter: MoEAdapter, router, scores, cand_idx: torch.Tensor, index: torch.Tensor,
                keep: torch.Tensor, renormalize: bool | None, substitute: LayerSubstitute,
                hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Under a substitute: the kept experts' weights [T, W] as the full model gives them, and what the
    skipped candidates add, sum over skipped e of weight_e x stand_in_e(x) ([T, H]; with `tokens`,
    a mixed pass's rows of this plan, for those tokens only: [len(tokens), H])."""
    full = adapter.combine(router, scores, cand_idx, torch.ones_like(cand_idx, dtype=torch.bool), renormalize)  # [T, K]
    dense = torch.zeros_like(scores.probs, dtype=full.dtype).scatter_(1, cand_idx, full)                      # [T, E]
    kept = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, index, keep)                                 # [T, E]
    skipped = dense.masked_fill(kept, 0.0)                                                                    # [T, E]
    if tokens is not None:
        skipped, hidden = skipped[tokens], hidden[tokens]
    return dense.gather(1, index) * keep, substitute.dense(skipped, hidden)


def experts_forward(experts: nn.Module, pending: dict):
    """The compacted experts path, plus what the layer's substitute left in `pending` for this pass."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = compact_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
        extra = pending.pop("extra", None)
        return out if extra is None else out + extra.to(out.dtype).view_as(out)
    return forward


def layer_substitute(plan: Plan, layer: MoELayer) -> LayerSubstitute | None:
    """The plan's stand-ins for `layer`, folded, on the layer's device (so a pass moves nothing), or None."""
    means = plan.means.means.get(layer.index) if plan.means is not None else None
    device = next((p.device for p in layer.experts.parameters() if p.device.type != "meta"),
                  means.device if means is not None else None)
    return fold_substitute(plan, layer.index, device)


def fold_substitute(plan: Plan, index: int, device) -> LayerSubstitute | None:
    """The plan's stand-ins for MoE layer `index`, folded, on `device`, or None (an engine's layer: the
    vLLM plugin's; `layer_substitute` for a transformers model's)."""
    if plan.means is None:
        if plan.substitute:
            raise AllocMoeError("the plan adds back skipped experts' means but they were not loaded (a plan built "
                                "with Plan.from_dict); load it with Plan.load(path), which reads its means file")
        return None
    if any(isinstance(policy, DistinctExperts) for policy in plan.layers.values()):
        raise AllocMoeError("a distinct-expert plan cannot carry a substitute (its steps choose experts outside a "
                            "token's own top-K); make the plan without --substitute")
    means = plan.means.means.get(index)
    if means is None:                 # a layer the plan gives no stand-in
        return None
    term = (plan.means.linear or {}).get(index)
    if term is None:
        return LayerSubstitute(offset=means.to(device))
    offset = means - torch.einsum("er,erh->eh", torch.einsum("eh,ehr->er", term.input_mean, term.down), term.up)
    return LayerSubstitute(offset=offset.to(device), down=term.down.to(device), up=term.up.to(device))
