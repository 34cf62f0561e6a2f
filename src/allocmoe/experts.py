"""The execution path that skips unselected (token, expert) pairs.

Routers patched by allocmoe return a [T, W] selection padded with the sentinel index E (weight 0).
`compact_experts_forward` drops those slots, runs transformers' own grouped_mm experts function on
the compacted list of S selected pairs (so every family's gating, bias and weight layout is
respected), and scatters the results back. Work is proportional to S, not to T * W.

It is also registered with transformers as the experts implementation "allocmoe", so
`model.set_experts_implementation("allocmoe")` uses it without a plan.

Shape legend: T = tokens, H = hidden size, W = slots per token (padded), S = selected pairs.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward


def compact_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    num_tokens, hidden_dim = hidden_states.shape
    selected = top_k_index < self.num_experts                             # [T, W]
    if bool(selected.all()):                                              # nothing to drop: native path
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    token_idx, slot = selected.nonzero(as_tuple=True)                     # [S], [S]
    out = torch.zeros(num_tokens, hidden_dim, dtype=hidden_states.dtype, device=hidden_states.device)  # [T, H]
    if token_idx.numel() == 0:
        return out
    pair_out = grouped_mm_experts_forward(                                # [S, H], already weighted
        self, hidden_states[token_idx], top_k_index[token_idx, slot][:, None], top_k_weights[token_idx, slot][:, None])
    return out.index_add_(0, token_idx, pair_out.to(out.dtype))


ALL_EXPERTS_FUNCTIONS.register("allocmoe", compact_experts_forward)
