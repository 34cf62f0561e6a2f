"""The execution path that skips unselected (token, expert) pairs.

Routers patched by allocmoe return a [T, W] selection padded with the sentinel index E (weight 0).
`compact_experts_forward` runs only the S selected pairs, so work is proportional to S, not T * W:
- on CUDA it drops the sentinel slots and runs transformers' own grouped_mm experts function on
  the compacted list (so every family's gating, bias and weight layout is respected);
- on CPU in fp32, for experts of real size, it runs `weights_first_experts_forward`: the same
  steps with each expert's matmul written weights-first (W @ x^T). With the weight as first
  operand MKL's sgemm handles the few-row operand far better: one DeepSeek-V2-Lite expert with
  4-64 rows runs 1.5-2.2x faster, with 256 rows 1.2x (benchmarks/cpu_speed.py measures whole
  models). An expert with at most 3 rows (batched decode) runs tokens-first (x @ W^T), MKL's
  few-row path, which streams W once where W @ x^T took twice as long. An expert's rows are
  widened to a whole block of 8 from 12 rows on, because MKL runs a ragged tail of rows at up to
  1.8x the cost of a whole block (benchmarks/sgemm_rows.py prints all three curves). Tiny
  experts keep grouped_mm, whose single call beats a Python loop over experts there, and so do
  bf16/fp16 experts, for which the weights-first order measured 10-35% slower.

Registered with transformers as the experts implementation "allocmoe", so
`model.set_experts_implementation("allocmoe")` uses it without a plan.

Shape legend: T = tokens, H = hidden size, W = slots per token (padded), S = selected pairs,
E = experts, O = a projection's output width.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward


WEIGHTS_FIRST_MIN_ELEMENTS = 1 << 20   # per expert projection; below it the per-expert loop costs more than it saves
ROW_BLOCK = 8         # MKL's sgemm runs the few-row operand in blocks of 8 rows; a ragged tail costs up to 3 extra blocks
PAD_FROM_ROWS = 12    # from here on rounding an expert's rows up to a whole block is cheaper than its tail
TOKENS_FIRST_MAX_ROWS = 3   # up to here x @ W^T: MKL's few-row path reads W once, W @ x^T costs 2x from 2 rows


def _prefers_weights_first(self: nn.Module, hidden_states: torch.Tensor) -> bool:
    """CPU, fp32 (MKL's sgemm; bf16/fp16 ran 10-35% slower weights-first), large experts, no EP."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    return (hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
            and not self._is_expert_parallel and up[0].numel() >= WEIGHTS_FIRST_MIN_ELEMENTS)


def experts_kernel_name(experts: nn.Module, hidden_states: torch.Tensor) -> str:
    """Which kernel compact_experts_forward runs for these experts and inputs like hidden_states."""
    return "weights-first" if _prefers_weights_first(experts, hidden_states) else "grouped_mm"


def compact_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    if _prefers_weights_first(self, hidden_states):
        return weights_first_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return compacted_grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights)


def compacted_grouped_mm_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """Drop the sentinel slots, then transformers' grouped_mm experts function on what is left."""
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


def _row_window(start: int, n: int, total: int) -> tuple[int, int]:
    """Rows [lo, hi) of the expert-sorted operand (total rows) to multiply for the expert whose n
    rows begin at `start`: from PAD_FROM_ROWS rows on, widened to a whole number of ROW_BLOCKs by
    taking neighbouring experts' rows, whose results are dropped. No copy, and on this machine's
    MKL 15 rows cost 1.7-1.8x what 16 do (benchmarks/sgemm_rows.py prints the curve)."""
    width = n if n < PAD_FROM_ROWS else -(-n // ROW_BLOCK) * ROW_BLOCK
    if width > total:
        return start, start + n
    lo = min(start, total - width)
    return lo, lo + width


def _weights_first_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], is_transposed: bool,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Per expert e, rows of x grouped by expert (counts[e] each): x_e @ W_e^T (+ b_e), computed as
    (W_e @ x_e^T)^T, or as written for at most TOKENS_FIRST_MAX_ROWS rows (batched decode's usual
    case): there MKL's sgemm streams W once, and W @ x^T took twice as long from 2 rows on (one
    DeepSeek-V2-Lite up projection, 2-3 rows: 0.71 ms against 1.72-1.81 ms on an Intel Xeon host,
    docs/speed/sgemm_rows_tokens_first.txt). weight is [E, O, in] ([E, in, O] when is_transposed)."""
    out_dim = weight.size(2) if is_transposed else weight.size(1)
    out = x.new_empty(x.size(0), out_dim)                                 # [S, O]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w = weight[e].t() if is_transposed else weight[e]                 # [O, in]
        if n <= TOKENS_FIRST_MAX_ROWS:
            rows = torch.mm(x[start:start + n], w.t())                    # [n, O]
        else:
            lo, hi = _row_window(start, n, x.size(0))
            rows = torch.mm(w, x[lo:hi].t()).t()[start - lo:start - lo + n]   # [n, O]
        if bias is not None:
            rows = rows + bias[e]
        out[start:start + n] = rows
        start += n
    return out


def weights_first_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """Selected pairs only, grouped by expert, one weights-first matmul per hit expert and projection.
    Slots holding the sentinel E (or any index >= E) are skipped."""
    num_tokens, hidden_dim = hidden_states.shape
    num_experts, width = self.num_experts, top_k_index.size(-1)
    expert_ids, order = torch.sort(top_k_index.reshape(-1))               # [T*W], sentinels last
    counts = torch.bincount(expert_ids.clamp(max=num_experts), minlength=num_experts + 1)[:num_experts].tolist()
    num_pairs = sum(counts)                                               # S
    order = order[:num_pairs]
    token_idx = order // width                                            # [S]
    x = hidden_states[token_idx]                                          # [S, H]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    h = _weights_first_linear(x, up, counts, self.is_transposed, up_bias)  # [S, 2I] or [S, I]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)           # [S, I]
    down_bias = self.down_proj_bias if self.has_bias else None
    y = _weights_first_linear(h, self.down_proj, counts, self.is_transposed, down_bias)  # [S, H]
    if self.has_post_expert_norm:
        y = self.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)    # [S, H]
    out = torch.zeros(num_tokens, hidden_dim, dtype=hidden_states.dtype, device=hidden_states.device)  # [T, H]
    return out.index_add_(0, token_idx, y.to(out.dtype))


ALL_EXPERTS_FUNCTIONS.register("allocmoe", compact_experts_forward)
