"""The execution path that skips unselected (token, expert) pairs.

Routers patched by allocmoe return a [T, W] selection padded with the sentinel index E (weight 0).
`compact_experts_forward` runs only the S selected pairs, so work is proportional to S, not T * W:
- on CUDA it drops the sentinel slots and runs transformers' own grouped_mm experts function on
  the compacted list (so every family's gating, bias and weight layout is respected);
- on CPU in fp32, for experts of real size, it runs `weights_first_experts_forward`: the same
  steps with each expert's matmul written weights-first (W @ x^T). With the weight as first
  operand MKL's sgemm handles the few-row operand far better: one DeepSeek-V2-Lite expert with
  4-64 rows runs 1.5-2.2x faster, with 256 rows 1.2x (benchmarks/cpu_speed.py measures whole
  models). An expert with at most 14 rows (batched decode) runs tokens-first (x @ W^T), MKL's
  few-row path, which streams W once per 3 rows where W @ x^T took twice as long from 2 rows;
  from 4 rows W is cut into slices of 16 output rows run as one batched matmul, so MKL's later
  passes over a slice read it from cache, not memory (one DeepSeek-V2-Lite up projection: 1.2-1.8
  ms at 4-14 rows, against 1.8-3.5 ms in one piece). An expert's rows are widened to a whole block
  of 8 from 12 rows on, because MKL runs a ragged tail of rows at up to 1.8x the cost of a whole
  block (benchmarks/sgemm_rows.py prints these curves). Weights stored transposed ([E, in, O],
  gpt_oss) run tokens-first at every row count: x @ W is then MKL's plain product, 2-3x faster
  than W @ x^T at 2-16 rows. Tiny experts keep grouped_mm, whose single call beats a Python loop
  over experts there, and so do bf16/fp16 experts, for which the weights-first order measured
  10-35% slower.
- with `pack_experts(model)` (opt-in: it holds a second copy of every routed expert's weights),
  an expert with more than 3 rows runs oneDNN's linear on weights packed once in its blocked
  layout, which streams them once for any row count. The default kernel's batched slices now
  match it up to 14 rows (docs/speed/sgemm_rows_batched.txt); from 15 rows it stays ahead of
  weights-first up to 256 rows (benchmarks/sgemm_rows.py --packed prints the curve).

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
TOKENS_FIRST_MAX_ROWS = 14  # up to here x @ W^T: MKL's few-row path reads W once per 3 rows, W @ x^T ~2x from 2 rows
SLICED_FROM_ROWS = 4        # from here on tokens-first runs W in slices, so MKL's later passes over a slice hit cache
SLICE_ROWS = 16             # output rows per slice (64-128 KB of weights), all slices in one batched matmul
PACKED_FROM_ROWS = 4        # with packed weights, from here on oneDNN (it costs 1.3x MKL's x @ W^T at 1-3 rows)
PACKED_ATTR = "_allocmoe_packed"


def _prefers_weights_first(self: nn.Module, hidden_states: torch.Tensor) -> bool:
    """CPU, fp32 (MKL's sgemm; bf16/fp16 ran 10-35% slower weights-first), large experts, no EP."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    return (hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
            and not self._is_expert_parallel and up[0].numel() >= WEIGHTS_FIRST_MIN_ELEMENTS)


def experts_kernel_name(experts: nn.Module, hidden_states: torch.Tensor) -> str:
    """Which kernel compact_experts_forward runs for these experts and inputs like hidden_states."""
    if not _prefers_weights_first(experts, hidden_states):
        return "grouped_mm"
    return "weights-first" + (f", oneDNN on packed weights from {PACKED_FROM_ROWS} rows"
                              if getattr(experts, PACKED_ATTR, None) else "")


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
                          bias: torch.Tensor | None, packed: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Per expert e, rows of x grouped by expert (counts[e] each): x_e @ W_e^T (+ b_e), computed as
    (W_e @ x_e^T)^T, or as written for at most TOKENS_FIRST_MAX_ROWS rows (batched decode's usual
    case), in slices of W from SLICED_FROM_ROWS rows (_tokens_first), or as written at any row
    count when the weights are stored transposed. With `packed` (pack_experts), from
    PACKED_FROM_ROWS rows on oneDNN's linear on the packed weights. weight is [E, O, in]
    ([E, in, O] when is_transposed). Timings: docs/speed/sgemm_rows_batched.txt."""
    out_dim = weight.size(2) if is_transposed else weight.size(1)
    out = x.new_empty(x.size(0), out_dim)                                 # [S, O]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if packed is not None and n >= PACKED_FROM_ROWS:
            rows = _packed_linear(x[start:start + n], packed[e])          # [n, O]
        elif is_transposed:                                               # weight[e] is [in, O]
            rows = torch.mm(x[start:start + n], weight[e])                # [n, O]
        elif n <= TOKENS_FIRST_MAX_ROWS:
            rows = _tokens_first(x[start:start + n], weight[e])           # [n, O]
        else:
            lo, hi = _row_window(start, n, x.size(0))
            rows = torch.mm(weight[e], x[lo:hi].t()).t()[start - lo:start - lo + n]   # [n, O]
        if bias is not None:
            rows = rows + bias[e]
        out[start:start + n] = rows
        start += n
    return out


def _tokens_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ w [O, in]^T. MKL's few-row sgemm passes over W once per 3 rows of x, each pass
    from memory. From SLICED_FROM_ROWS rows W is cut into slices of SLICE_ROWS output rows, run as
    one batched matmul: MKL then makes all its passes over a slice while it is in cache (one
    DeepSeek-V2-Lite up projection at 4-14 rows: 1.2-1.8 ms, against 1.8-3.5 ms in one piece;
    docs/speed/sgemm_rows_batched.txt). Slices of 256 run one by one, as before, left the later
    passes mostly to memory: 1.47-2.23 ms at 4-14 rows where these took 1.13-1.68, side by side."""
    num_rows, out_dim = x.size(0), w.size(0)
    if num_rows < SLICED_FROM_ROWS or out_dim < 2 * SLICE_ROWS:
        return torch.mm(x, w.t())
    whole = out_dim - out_dim % SLICE_ROWS                                # rows in whole slices
    slices = w[:whole].unflatten(0, (whole // SLICE_ROWS, SLICE_ROWS)).transpose(1, 2)   # [O/s, in, s] views
    out = torch.matmul(x, slices).transpose(0, 1).reshape(num_rows, whole)               # [n, whole]
    if whole < out_dim:                                                   # a ragged last slice
        out = torch.cat([out, torch.mm(x, w[whole:].t())], dim=1)
    return out


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ W^T with W packed by oneDNN (pack_experts)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


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
    packed = getattr(self, PACKED_ATTR, None)
    h = _weights_first_linear(x, up, counts, self.is_transposed, up_bias, packed and packed["up"])  # [S, 2I] or [S, I]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)           # [S, I]
    down_bias = self.down_proj_bias if self.has_bias else None
    y = _weights_first_linear(h, self.down_proj, counts, self.is_transposed, down_bias,
                              packed and packed["down"])                  # [S, H]
    if self.has_post_expert_norm:
        y = self.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)    # [S, H]
    out = torch.zeros(num_tokens, hidden_dim, dtype=hidden_states.dtype, device=hidden_states.device)  # [T, H]
    return out.index_add_(0, token_idx, y.to(out.dtype))


class PackedExperts:
    """Every CPU fp32 routed experts module of a model, with its weights also packed for oneDNN's
    linear (a second copy: the experts' memory doubles; a snapshot, so pack again after changing the
    weights). `remove()` (or leaving the `with` block) drops the copies; the model's own weights are
    never touched."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def __enter__(self) -> "PackedExperts":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for module in self.modules:
            module.__dict__.pop(PACKED_ATTR, None)
        self.modules = []

    @property
    def bytes(self) -> int:
        """The packed copies' size: what packing added (the same as the experts' own weights)."""
        return sum(w.numel() * 4 for m in self.modules for parts in getattr(m, PACKED_ATTR, {}).values()
                   for w in parts)


@torch.no_grad()
def pack_experts(model: nn.Module) -> PackedExperts:
    """Pack each routed expert's projections for oneDNN, for every experts module the CPU kernel runs
    weights-first (CPU, fp32, projections of 1M weights or more). Refused where none qualifies, and,
    before anything is packed, when the second copy would not fit in free memory."""
    from .adapters import adapter_for_model
    from ..core.memory import check_free_memory
    from ..errors import AllocMoeError

    if not torch.backends.mkldnn.is_available():
        raise AllocMoeError("packed experts need oneDNN (torch.backends.mkldnn), which this torch build lacks; "
                            "run without packing")
    modules = []
    for layer in adapter_for_model(model).moe_layers(model):
        experts = layer.experts
        probe = torch.empty(1, model.config.hidden_size, dtype=next(experts.parameters()).dtype,
                            device=next(experts.parameters()).device)
        if _prefers_weights_first(experts, probe):
            modules.append(experts)
    if not modules:
        raise AllocMoeError("no experts to pack: packing serves the CPU kernel's fp32 experts of real size "
                            "(projections of 1M weights or more); run without packing")
    check_free_memory(sum(p.numel() * p.element_size() for m in modules for p in m.parameters()),
                      torch.device("cpu"), "packing the experts",
                      "run without packing (bench: drop --packed-experts), or on fewer layers",
                      detail=" for a second copy of the routed experts")
    for experts in modules:
        up = experts.gate_up_proj if experts.has_gate else experts.up_proj
        packed = {}
        for name, weight in (("up", up), ("down", experts.down_proj)):
            mats = weight.transpose(1, 2) if experts.is_transposed else weight        # [E, O, in]
            packed[name] = [torch.ops.mkldnn._reorder_linear_weight(m.contiguous(), 16) for m in mats]
        setattr(experts, PACKED_ATTR, packed)
    return PackedExperts(modules)


ALL_EXPERTS_FUNCTIONS.register("allocmoe", compact_experts_forward)
