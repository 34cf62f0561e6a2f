"""Measure expert means for a plan's substitute: one pass of the unmodified model over calibration text.

For each MoE layer and routed expert e, the mean of e's output f_e(x) over the calibration tokens
whose top-K_orig holds e (the tokens the full model sends to it), read where the model's own experts
module runs, so every family's layout, activation and bias are respected. Unweighted: the plan's
routing multiplies by each token's own gate weight at inference (routing/apply.py).

Shape legend: T = tokens, K = K_orig, E = routed experts, H = hidden size.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..core.means import ExpertMeans
from ..routing.adapters import adapter_for_model
from ..routing.experts import compact_experts_forward


@torch.no_grad()
def measure_expert_means(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = False) -> ExpertMeans:
    """Each expert's mean output over the calibration `windows` [N, S] routed to it at full K."""
    adapter = adapter_for_model(model)
    layers = adapter.moe_layers(model)
    num_experts = adapter.num_experts()
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, torch.Tensor] = {}

    def record(index: int):
        def hook(experts, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]                    # [T, H]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]       # [T, K]
            k = top_k_index.size(-1)
            pairs = top_k_index.reshape(-1, 1)                                      # [T*K, 1]
            outputs = compact_experts_forward(experts, hidden.repeat_interleave(k, dim=0), pairs,
                                              torch.ones(pairs.shape, dtype=hidden.dtype, device=hidden.device))
            sums.setdefault(index, torch.zeros(num_experts, hidden.size(-1), dtype=torch.float64))
            counts.setdefault(index, torch.zeros(num_experts, dtype=torch.float64))
            sums[index].index_add_(0, pairs[:, 0].cpu(), outputs.double().cpu())   # [E, H]
            counts[index] += torch.bincount(pairs[:, 0].cpu(), minlength=num_experts).double()
        return hook

    hooks = [layer.experts.register_forward_pre_hook(record(layer.index), with_kwargs=True) for layer in layers]
    device = next(model.parameters()).device
    try:
        for batch in tqdm(windows.split(batch_size), desc="expert means", unit="batch", disable=not progress):
            model(input_ids=batch.to(device))
    finally:
        for hook in hooks:
            hook.remove()
    means = {index: (sums[index] / counts[index].clamp_min(1)[:, None]).float() for index in sums}
    return ExpertMeans(means=means, tokens=int(windows.numel()))
