"""apply_plan: install a plan on a live transformers model, reversibly, and count what it spends.

Installing patches two things per MoE layer, as instance attributes (the class is never edited):
  router.forward   -> score with the family adapter, let the layer's policy pick a prefix of each
                      token's top-K_orig, combine with the family's weights, pad with sentinel E;
  experts.forward  -> the compacted path in experts.py, which skips the sentinel slots.
A forward pre-hook on the model reads the attention mask so padding never enters the Alloc-T pool
or the counts. `PlanHandle.remove()` (or leaving the `with` block) deletes exactly these, restoring
the model bit for bit.

Shape legend: T = tokens in the pass, E = routed experts, K = K_orig, W = widest selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .adapters import MoEAdapter, MoELayer, adapter_for_model
from .errors import AllocMoeError
from .experts import compact_experts_forward
from .plan import Plan
from .policies import AllocT, Policy, StaticTopK, expected_alloc_t_activations, prefix_mask

# Called as fn(layer_index, cand_idx [T, K], cand_probs [T, K], counts [T], valid [T]) on every
# routed pass: each token's ranked candidates, their probabilities, and how many it keeps.
Recorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_MARK = "_allocmoe_patched"


@dataclass
class RoutingContext:
    """What a router cannot see by itself: the current batch's padding mask and batch size."""
    attention_mask: torch.Tensor | None = None    # [B, S_total] 1 = real token, from the model call
    batch_size: int = 1
    recorders: list[Recorder] = field(default_factory=list)

    def valid_mask(self, num_tokens: int, device) -> torch.Tensor:
        mask = self.attention_mask
        if mask is not None and mask.dim() == 2 and num_tokens % mask.size(0) == 0:
            step_len = num_tokens // mask.size(0)
            if step_len <= mask.size(1):
                return mask[:, -step_len:].reshape(-1).to(device=device, dtype=torch.bool)   # [T]
        return torch.ones(num_tokens, dtype=torch.bool, device=device)


class LayerStats:
    """Activations and real tokens one layer has seen, kept on the device until read."""

    def __init__(self):
        self.activations = 0
        self.tokens = 0

    def add(self, counts: torch.Tensor, valid: torch.Tensor) -> None:
        self.activations = self.activations + (counts * valid).sum()
        self.tokens = self.tokens + valid.sum()

    def add_uniform(self, k: int, valid: torch.Tensor) -> None:
        real = valid.sum()
        self.activations = self.activations + k * real
        self.tokens = self.tokens + real


def _static_k(policy: Policy, valid: torch.Tensor) -> int | None:
    """The k every token gets when the policy cannot vary it: static top-k, or Alloc-T on a single
    real token (decode of one sequence), where the pool rule gives k_base + round_half_up(k - k_base)."""
    if isinstance(policy, StaticTopK):
        return policy.k
    if isinstance(policy, AllocT) and valid.numel() == 1 and bool(valid[0]):
        return expected_alloc_t_activations(policy.k, policy.k_base, 1)
    return None


def _router_forward(adapter: MoEAdapter, layer: MoELayer, policy: Policy, k_orig: int,
                    ctx: RoutingContext, stats: LayerStats, renormalize: bool | None):
    router, num_experts = layer.router, adapter.num_experts()

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])           # [T, H]
        scores = adapter.score(router, hidden)
        valid = ctx.valid_mask(hidden.size(0), hidden.device)                 # [T]
        static_k = _static_k(policy, valid) if not ctx.recorders else None
        if static_k is not None:                                              # fast path: no per-token counts
            index = scores.ranking.topk(static_k, dim=-1).indices             # [T, k]
            weights = adapter.combine(router, scores, index, torch.ones_like(index, dtype=torch.bool), renormalize)
            stats.add_uniform(static_k, valid)
            return scores.logits, weights, index
        cand_idx = scores.ranking.topk(k_orig, dim=-1).indices                # [T, K] best first
        # [T, K]; made non-increasing along the ranking (a no-op unless the family ranks by another
        # key, as DeepSeek-V3's bias does), so every policy's choice is a prefix of the ranking
        cand_probs = scores.probs.gather(-1, cand_idx).cummin(-1).values
        counts = policy.counts(cand_probs, valid, ctx.batch_size)             # [T]
        width = policy.k if isinstance(policy, StaticTopK) else k_orig         # no host sync on counts
        keep = prefix_mask(counts, width)                                     # [T, W]
        index = cand_idx[:, :width]                                           # [T, W]
        weights = adapter.combine(router, scores, index, keep, renormalize)   # [T, W]
        stats.add(counts, valid)
        for record in ctx.recorders:
            record(layer.index, cand_idx, cand_probs, counts, valid)
        return scores.logits, weights, index.masked_fill(~keep, num_experts)

    return forward


class PlanHandle:
    """A plan installed on a model. Use as a context manager, or call `remove()`."""

    def __init__(self, model: nn.Module, plan: Plan, layers: list[MoELayer], ctx: RoutingContext,
                 stats: dict[int, LayerStats], hook):
        self.model, self.plan, self.context = model, plan, ctx
        self._layers, self._stats, self._hook = layers, stats, hook
        self.active = True

    def __enter__(self) -> "PlanHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Restore the model exactly as it was."""
        if not self.active:
            return
        for layer in self._layers:
            for module in (layer.router, layer.experts):
                for name in ("forward", _MARK):
                    if name in module.__dict__:
                        delattr(module, name)
        self._hook.remove()
        self.active = False

    # -- accounting ------------------------------------------------------------------------
    def reset_counters(self) -> None:
        for stats in self._stats.values():
            stats.activations, stats.tokens = 0, 0

    def layer_activations(self) -> dict[int, float]:
        """Measured activations per real token, per MoE layer."""
        return {index: float(s.activations) / max(float(s.tokens), 1.0) for index, s in self._stats.items()}

    def activations_per_token(self) -> float:
        """Measured activations per token summed over MoE layers: the number the budget bounds."""
        return sum(self.layer_activations().values())

    def tokens_seen(self) -> int:
        return int(max((float(s.tokens) for s in self._stats.values()), default=0))


def apply_plan(model: nn.Module, plan: Plan, renormalize: bool | None = None) -> PlanHandle:
    """Install `plan` on `model` in place; returns a handle that restores the model on exit.

    renormalize: None keeps each family's native combine; True/False forces renormalising the kept
    weights (or not) for every layer.
    """
    adapter = adapter_for_model(model)
    plan.check_model(model)
    layers = adapter.moe_layers(model)
    if any(_MARK in layer.router.__dict__ for layer in layers):
        raise AllocMoeError("a plan is already applied to this model; remove its handle first")
    ctx = RoutingContext()
    stats = {layer.index: LayerStats() for layer in layers}
    k_orig = adapter.k_orig()
    for layer in layers:
        policy = plan.layers[layer.index]
        policy.check(k_orig)
        layer.router.forward = _router_forward(adapter, layer, policy, k_orig, ctx, stats[layer.index], renormalize)
        layer.experts.forward = compact_experts_forward.__get__(layer.experts)
        setattr(layer.router, _MARK, True)
        setattr(layer.experts, _MARK, True)

    def read_batch(module, args, kwargs):
        ctx.attention_mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        ctx.batch_size = int(ids.shape[0]) if ids is not None and ids.dim() >= 2 else 1

    hook = model.register_forward_pre_hook(read_batch, with_kwargs=True)
    return PlanHandle(model, plan, layers, ctx, stats, hook)


def static_plan(model: nn.Module, k_per_layer: dict[int, int] | list[int], method: str = "manual") -> Plan:
    """A plan of static top-k per layer; a list is taken in MoE-layer order."""
    from .plan import model_fingerprint

    fingerprint = model_fingerprint(model)
    indices = fingerprint["moe_layers"]
    if not isinstance(k_per_layer, dict):
        k_per_layer = dict(zip(indices, k_per_layer))
    layers = {index: StaticTopK(int(k)) for index, k in k_per_layer.items()}
    return Plan(model=fingerprint, layers=layers, method=method, budget=float(sum(k_per_layer.values())))


class _experts_forward_swapped:
    """Context manager: every MoE layer's experts module runs `forward` (bound to it) until exit."""

    def __init__(self, model: nn.Module, forward):
        self._experts = [layer.experts for layer in adapter_for_model(model).moe_layers(model)]
        self._forward = forward

    def __enter__(self):
        for experts in self._experts:
            experts.forward = self._forward.__get__(experts)
        return self

    def __exit__(self, *exc):
        for experts in self._experts:
            if "forward" in experts.__dict__:
                del experts.forward


def _no_routed_output(self, hidden_states, *args, **kwargs):
    return torch.zeros_like(hidden_states)


def routed_experts_off(model: nn.Module) -> _experts_forward_swapped:
    """Every MoE layer's routed experts contribute nothing (routers and shared experts still run).
    Used to time the part of a forward pass that no budget can remove."""
    return _experts_forward_swapped(model, _no_routed_output)


def allocmoe_experts(model: nn.Module) -> _experts_forward_swapped:
    """The model's own routing, with its experts run by allocmoe's kernel (as under a plan), so a
    benchmark compares budgets, not kernels."""
    return _experts_forward_swapped(model, compact_experts_forward)
