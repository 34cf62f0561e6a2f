"""The substitute under a plan: what skipped experts add back, and where it is added.

A plan with means (`plan.means`, core/means.py) keeps its experts at the weights the full model gives
them (for renormalising routers, normalised over the original top-K_orig, not the kept set) and adds,
per token, the sum over its skipped top-K_orig candidates of weight x that expert's calibrated mean
output. The router's forward (routing/apply.py) computes it and leaves it in the layer's `pending`
dict; the experts' forward here adds it to their output in the same pass.

Shape legend: T = tokens, E = routed experts, K = K_orig, W = selected slots, S = skipped slots,
H = hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.plan import Plan
from ..core.policies import DistinctExperts
from ..errors import AllocMoeError
from .adapters import MoEAdapter, MoELayer
from .experts import compact_experts_forward


def substituted(adapter: MoEAdapter, router, scores, cand_idx: torch.Tensor, index: torch.Tensor,
                 keep: torch.Tensor, renormalize: bool | None, means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under a substitute: the kept experts' weights [T, W] as the full model gives them, and what the
    skipped candidates add, sum over skipped e of weight_e x mean_e ([T, H])."""
    full = adapter.combine(router, scores, cand_idx, torch.ones_like(cand_idx, dtype=torch.bool), renormalize)  # [T, K]
    dense = torch.zeros_like(scores.probs, dtype=full.dtype).scatter_(1, cand_idx, full)                      # [T, E]
    kept = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, index, keep)                                 # [T, E]
    extra = dense.masked_fill(kept, 0.0) @ means.to(device=dense.device, dtype=dense.dtype)                 # [T, H]
    return dense.gather(1, index) * keep, extra


def skipped_means(weights: torch.Tensor, index: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """sum over a token's skipped slots of weight x that expert's mean: weights, index [T, S] -> [T, H].
    Gathered per slot when that is small (decode), else as a dense [T, E] x [E, H] product (prefill)."""
    num_tokens, slots = index.shape
    if num_tokens * slots * means.size(-1) <= 1 << 22:
        return torch.einsum("ts,tsh->th", weights.to(means.dtype), means[index])
    dense = torch.zeros(num_tokens, means.size(0), dtype=means.dtype, device=means.device)
    return dense.scatter_add_(1, index, weights.to(means.dtype)) @ means


def experts_forward(experts: nn.Module, pending: dict):
    """The compacted experts path, plus what the layer's substitute left in `pending` for this pass."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = compact_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
        extra = pending.pop("extra", None)
        return out if extra is None else out + extra.to(out.dtype).view_as(out)
    return forward


def layer_means(plan: Plan, layer: MoELayer) -> torch.Tensor | None:
    """The plan's means [E, H] for `layer`, on the layer's device (so a pass moves nothing), or None."""
    if plan.means is None:
        if plan.substitute:
            raise AllocMoeError("the plan adds back skipped experts' means but they were not loaded (a plan built "
                                "with Plan.from_dict); load it with Plan.load(path), which reads its means file")
        return None
    if any(isinstance(policy, DistinctExperts) for policy in plan.layers.values()):
        raise AllocMoeError("a distinct-expert plan cannot carry a substitute (its steps choose experts outside a "
                            "token's own top-K); make the plan without --substitute")
    means = plan.means.means[layer.index]
    device = next((p.device for p in layer.experts.parameters() if p.device.type != "meta"), means.device)
    return means.to(device)
