"""apply_plan: install a plan on a live transformers model, reversibly, and count what it spends.

Installing patches two things per MoE layer, as instance attributes (the class is never edited):
  router.forward   -> score with the family adapter, let the layer's policy pick a prefix of each
                      token's top-K_orig, combine with the family's weights, pad with sentinel E;
  experts.forward  -> the compacted path in experts.py, which skips the sentinel slots.
A forward pre-hook on the model reads the attention mask so padding never enters the Alloc-T pool
or the counts. `PlanHandle.remove()` (or leaving the `with` block) deletes exactly these, restoring
the model bit for bit.

Several plans can be installed at once (`apply_plans`): each row of a batch is then routed by its
own plan, chosen through `handle.context.row_plans`, which is how the server batches requests with
different budgets into one forward pass. With `context.track_rows` set, each pass leaves the
activations each row spent, summed over MoE layers, in `context.row_activations`.

Shape legend: T = tokens in the pass, E = routed experts, K = K_orig, W = widest selection,
B = rows (sequences) in the batch, S = tokens per row in the pass (T = B * S).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .adapters import MoEAdapter, MoELayer, adapter_for_model
from ..errors import AllocMoeError
from .experts import compact_experts_forward
from ..core.plan import Plan
from ..core.policies import AllocT, Policy, StaticTopK, expected_alloc_t_activations, prefix_mask

# Called as fn(layer_index, cand_idx [T, K], cand_probs [T, K], counts [T], valid [T]) on every
# routed pass: each token's ranked candidates, their probabilities, and how many it keeps.
Recorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_MARK = "_allocmoe_patched"
_HANDLE = "_allocmoe_handle"        # on the model while a handle is installed: see active_handle()
_COPIED = ("this model is a copy of a model that had a plan applied (the copy keeps the plan's patches, which "
           "still route with the original's modules and count into the original's handle); copy the model "
           "before applying the plan, or clear the copy with `allocmoe.routing.apply.active_handle(copy).remove()` "
           "and apply the plan to it")


@dataclass
class RoutingContext:
    """What a router cannot see by itself: the current batch's padding mask and batch size."""
    attention_mask: torch.Tensor | None = None    # [B, S_total] 1 = real token, from the model call
    batch_size: int = 1
    recorders: list[Recorder] = field(default_factory=list)
    row_plans: list[int] | None = None            # per batch row, which installed plan routes it; None = plan 0
    track_rows: bool = False                      # fill row_activations on every pass (the server's usage)
    row_activations: torch.Tensor | None = None   # [B] activations per row, summed over the MoE layers of a pass

    def plan_rows(self) -> dict[int, list[int]]:
        """Installed plan -> the batch rows it routes in this pass."""
        if self.row_plans is None:
            return {0: list(range(self.batch_size))}
        if len(self.row_plans) != self.batch_size:
            raise AllocMoeError(f"row_plans names {len(self.row_plans)} rows for a batch of {self.batch_size}")
        groups: dict[int, list[int]] = {}
        for row, plan_index in enumerate(self.row_plans):
            groups.setdefault(plan_index, []).append(row)
        return groups

    def add_row_activations(self, counts: torch.Tensor, valid: torch.Tensor) -> None:
        per_row = (counts * valid).reshape(self.batch_size, -1).sum(-1)      # [B]
        self.row_activations = per_row if self.row_activations is None else self.row_activations + per_row

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


def _mixed_counts(policies: list[Policy], groups: dict[int, list[int]], cand_probs: torch.Tensor,
                  valid: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Counts [T] when rows follow different plans: each plan's policy decides for its own rows
    alone (its rows' tokens are its whole pool), as if those rows had been the batch."""
    counts = torch.empty(valid.shape, dtype=torch.long, device=valid.device)        # [T]
    per_row = cand_probs.size(0) // batch_size                                      # S
    for plan_index, rows in groups.items():
        row_idx = torch.tensor(rows, device=valid.device)
        tokens = (row_idx[:, None] * per_row + torch.arange(per_row, device=valid.device)).reshape(-1)  # [b*S]
        counts[tokens] = policies[plan_index].counts(cand_probs[tokens], valid[tokens], len(rows))
    return counts


def _router_forward(adapter: MoEAdapter, layer: MoELayer, policies: list[Policy], k_orig: int,
                    ctx: RoutingContext, stats: LayerStats, renormalize: bool | None):
    """`policies[i]` is this layer's policy under installed plan i (the list grows as plans are added)."""
    router, num_experts = layer.router, adapter.num_experts()

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])           # [T, H]
        scores = adapter.score(router, hidden)
        valid = ctx.valid_mask(hidden.size(0), hidden.device)                 # [T]
        groups = ctx.plan_rows()
        policy = policies[next(iter(groups))] if len(groups) == 1 else None
        static_k = _static_k(policy, valid) if policy is not None and not ctx.recorders else None
        if static_k is not None:                                              # fast path: no per-token counts
            index = scores.ranking.topk(static_k, dim=-1).indices             # [T, k]
            weights = adapter.combine(router, scores, index, torch.ones_like(index, dtype=torch.bool), renormalize)
            stats.add_uniform(static_k, valid)
            if ctx.track_rows:
                ctx.add_row_activations(torch.full_like(valid, static_k, dtype=torch.long), valid)
            return scores.logits, weights, index
        cand_idx = scores.ranking.topk(k_orig, dim=-1).indices                # [T, K] best first
        # [T, K]; made non-increasing along the ranking (a no-op unless the family ranks by another
        # key, as DeepSeek-V3's bias does), so every policy's choice is a prefix of the ranking
        cand_probs = scores.probs.gather(-1, cand_idx).cummin(-1).values
        if policy is not None:
            counts = policy.counts(cand_probs, valid, ctx.batch_size)         # [T]
        else:
            counts = _mixed_counts(policies, groups, cand_probs, valid, ctx.batch_size)
        # no host sync on counts: the width comes from the policy, not from the counts
        width = policy.k if isinstance(policy, StaticTopK) else k_orig
        keep = prefix_mask(counts, width)                                     # [T, W]
        index = cand_idx[:, :width]                                           # [T, W]
        weights = adapter.combine(router, scores, index, keep, renormalize)   # [T, W]
        stats.add(counts, valid)
        if ctx.track_rows:
            ctx.add_row_activations(counts, valid)
        for record in ctx.recorders:
            record(layer.index, cand_idx, cand_probs, counts, valid)
        return scores.logits, weights, index.masked_fill(~keep, num_experts)

    return forward


class PlanHandle:
    """A plan installed on a model. Use as a context manager, or call `remove()`."""

    def __init__(self, model: nn.Module, plans: list[Plan], layers: list[MoELayer], ctx: RoutingContext,
                 stats: dict[int, LayerStats], hook, policies: dict[int, list[Policy]], k_orig: int):
        self.model, self.plans, self.context = model, plans, ctx
        self._layers, self._stats, self._hook = layers, stats, hook
        self._policies, self._k_orig = policies, k_orig
        self.active = True
        self._entered = False
        self._model_id = id(model)      # a copied model carries a copy of this handle, and the original's id

    @property
    def plan(self) -> Plan:
        """The first installed plan (the only one, for `apply_plan`)."""
        return self.plans[0]

    def add_plan(self, plan: Plan) -> int:
        """Install one more plan beside the others; returns its index for `context.row_plans`."""
        if not self.active:
            raise AllocMoeError("this plan handle was removed; apply the plans again")
        plan.check_model(self.model)
        for layer in self._layers:
            plan.layers[layer.index].check(self._k_orig)
        for layer in self._layers:
            self._policies[layer.index].append(plan.layers[layer.index])
        self.plans.append(plan)
        return len(self.plans) - 1

    def __enter__(self) -> "PlanHandle":
        if not self.active:          # entering again would silently run the unmodified model
            raise AllocMoeError("this plan handle was removed (its `with` block ended); apply the plan again: "
                                "`with apply_plan(model, plan) as handle:`")
        if self._entered:            # the inner block's end would remove the plan under the outer one
            raise AllocMoeError("this plan handle is already in a `with` block; use it in one `with` block "
                                "(leaving a nested one would remove the plan while the outer one still runs)")
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        self._entered = False
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
        self.model.__dict__.pop(_HANDLE, None)
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
    return apply_plans(model, [plan], renormalize)


def apply_plans(model: nn.Module, plans: list[Plan], renormalize: bool | None = None) -> PlanHandle:
    """Install several plans at once: row r of a batch follows plan `handle.context.row_plans[r]`
    (all rows follow plan 0 while `row_plans` is None). `handle.add_plan` installs more later."""
    if not plans:
        raise AllocMoeError("apply_plans needs at least one plan")
    adapter = adapter_for_model(model)
    for plan in plans:
        plan.check_model(model)
    layers = adapter.moe_layers(model)
    installed = active_handle(model)
    if installed is not None and installed._model_id != id(model):
        raise AllocMoeError(_COPIED)
    if any(_MARK in layer.router.__dict__ for layer in layers):
        raise AllocMoeError("a plan is already applied to this model; remove its handle first (`handle.remove()` "
                            "or leave its `with` block), or install several plans together with apply_plans "
                            "or handle.add_plan")
    if any("forward" in module.__dict__ for layer in layers for module in (layer.router, layer.experts)):
        raise AllocMoeError("this model's MoE layers already run a replaced forward (inside routed_experts_off "
                            "or allocmoe_experts?); apply the plan outside that block")
    ctx = RoutingContext()
    stats = {layer.index: LayerStats() for layer in layers}
    k_orig = adapter.k_orig()
    policies = {layer.index: [plan.layers[layer.index] for plan in plans] for layer in layers}
    for layer in layers:
        for policy in policies[layer.index]:
            policy.check(k_orig)
    for layer in layers:
        layer.router.forward = _router_forward(adapter, layer, policies[layer.index], k_orig, ctx,
                                               stats[layer.index], renormalize)
        layer.experts.forward = compact_experts_forward.__get__(layer.experts)
        setattr(layer.router, _MARK, True)
        setattr(layer.experts, _MARK, True)

    def read_batch(module, args, kwargs):
        if module is not model:          # a deep copy keeps this hook and the routers bound to the original
            raise AllocMoeError(_COPIED)
        ctx.attention_mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        ctx.batch_size = int(ids.shape[0]) if ids is not None and ids.dim() >= 2 else 1
        ctx.row_activations = None

    hook = model.register_forward_pre_hook(read_batch, with_kwargs=True)
    handle = PlanHandle(model, list(plans), layers, ctx, stats, hook, policies, k_orig)
    model.__dict__[_HANDLE] = handle
    return handle


def active_handle(model: nn.Module) -> PlanHandle | None:
    """The handle of the plans installed on `model`, if any (so code handed a patched model can
    count what it spends instead of assuming the full budget)."""
    return model.__dict__.get(_HANDLE)


def static_plan(model: nn.Module, k_per_layer: dict[int, int] | list[int], method: str = "manual") -> Plan:
    """A plan of static top-k per layer; a list is taken in MoE-layer order."""
    from ..core.plan import model_fingerprint

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
