"""apply_plan: install a plan on a live transformers model, reversibly, and count what it spends.

Installing patches two things per MoE layer, as instance attributes (the class is never edited):
  router.forward   -> score with the family adapter, let the layer's policy pick from each token's
                      top-K_orig (a prefix of it, or for `distinct` the candidates in the step's
                      chosen set), combine with the family's weights, pad with sentinel E
                      (routing/router.py: the forward and its pieces; routing/select.py: the selection);
  experts.forward  -> the compacted path in experts.py, which skips the sentinel slots.
A forward pre-hook on the model reads the attention mask so padding never enters the Alloc-T pool
or the counts. `PlanHandle.remove()` (or leaving the `with` block) deletes exactly these, restoring
the model bit for bit.

Several plans can be installed at once (`apply_plans`): each row of a batch is then routed by its
own plan, chosen through `handle.context.row_plans`, which is how the server batches requests with
different budgets into one forward pass. With `context.track_rows` set, each pass leaves the
activations each row spent, summed over MoE layers, in `context.row_activations`.

A plan with means (`plan.means`) also adds back what it skips (routing/substitute.py).

A pass of B rows and S positions is S decode steps of B tokens (step s = position s of every row;
in a left-padded prefill, column s). The distinct policy bounds the experts each step loads, and
the handle counts them (mean and max per layer) where it runs, or for every policy with
`context.count_steps`. `context.decode_steps` makes Alloc-T pool per step too, so a teacher-forced
[B, S] pass routes exactly as S batched decode steps would (`eval --decode-batch`).

Shape legend: T = tokens in the pass, E = routed experts, K = K_orig, W = widest selection,
B = rows (sequences) in the batch, S = tokens per row in the pass (T = B * S).
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters import MoELayer, adapter_for_model
from ..errors import AllocMoeError
from .experts import compact_experts_forward
from .router import LayerStats, Recorder, RoutingContext, router_forward  # noqa: F401  (Recorder: re-exported)
from .substitute import LayerSubstitute, experts_forward, layer_substitute
from ..core.plan import Plan
from .layout import check_plan, model_fingerprint
from ..core.policies import DistinctExperts, Policy, StaticTopK

_MARK = "_allocmoe_patched"
_SAVED = "_allocmoe_old_forward"     # under an accelerate hook: the hook's own _old_forward, put back on removal
_HANDLE = "_allocmoe_handle"        # on the model while a handle is installed: see active_handle()
_COPIED = ("this model is a copy of a model that had a plan applied (the copy keeps the plan's patches, which "
           "still route with the original's modules and count into the original's handle); copy the model "
           "before applying the plan, or clear the copy with `allocmoe.routing.apply.active_handle(copy).remove()` "
           "and apply the plan to it")


class PlanHandle:
    """A plan installed on a model. Use as a context manager, or call `remove()`."""

    def __init__(self, model: nn.Module, plans: list[Plan], layers: list[MoELayer], ctx: RoutingContext,
                 stats: dict[int, LayerStats], hook, policies: dict[int, list[Policy]], k_orig: int,
                 means: dict[int, list[LayerSubstitute | None]]):
        self.model, self.plans, self.context = model, plans, ctx
        self._layers, self._stats, self._hook = layers, stats, hook
        self._policies, self._k_orig, self._means = policies, k_orig, means
        self.active = True
        self._entered = False
        self._model_id = id(model)      # a copied model carries a copy of this handle, and the original's id

    @property
    def plan(self) -> Plan:
        """The first installed plan (the only one, for `apply_plan`)."""
        return self.plans[0]

    def add_plan(self, plan: Plan) -> int:
        """Install one more plan (a Plan, a plan file's path or a plan document, as for apply_plan) beside
        the others; returns its index for `context.row_plans`."""
        return self._install(plan, len(self.plans), "add_plan")

    def replace_plan(self, index: int, plan: Plan) -> None:
        """Install `plan` in slot `index`, in place of the plan there (a server's plan cache evicting one
        it made for a budget). Rows that still name `index` route by the new plan from their next pass:
        the caller replaces only a plan no running row holds."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.plans):
            raise AllocMoeError(f"replace_plan: index must be one of the installed plans' 0..{len(self.plans) - 1}, "
                                f"got {index!r}; give an index add_plan returned")
        self._install(plan, index, "replace_plan")

    def _install(self, plan, index: int, caller: str) -> int:
        """Check `plan` against this model, then put it at `index` (the end: a new slot)."""
        if not self.active:
            raise AllocMoeError("this plan handle was removed; apply the plans again")
        plan = as_plan(plan, caller)
        check_plan(plan, self.model)
        for layer in self._layers:
            plan.layers[layer.index].check(self._k_orig)
        added = {layer.index: layer_substitute(plan, layer) for layer in self._layers}
        def put(slots: list, value) -> None:       # every list holds one entry per installed plan
            if index == len(slots):
                slots.append(value)
            else:
                slots[index] = value

        for layer in self._layers:
            put(self._policies[layer.index], plan.layers[layer.index])
            put(self._means[layer.index], added[layer.index])
        put(self.plans, plan)
        return index

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
                _restore_forward(module)
                module.__dict__.pop(_MARK, None)
        self._hook.remove()
        self.model.__dict__.pop(_HANDLE, None)
        self.active = False

    # -- accounting ------------------------------------------------------------------------
    def reset_counters(self) -> None:
        for stats in self._stats.values():
            stats.reset()

    def _counts(self) -> dict[int, LayerStats]:
        return {index: stats.folded() for index, stats in self._stats.items()}

    def layer_activations(self) -> dict[int, float]:
        """Measured activations per real token, per MoE layer."""
        return {index: float(s.activations) / max(float(s.tokens), 1.0) for index, s in self._counts().items()}

    def activations_per_token(self) -> float:
        """Measured activations per token summed over MoE layers: the number the budget bounds."""
        return sum(self.layer_activations().values())

    def tokens_seen(self) -> int:
        return int(max((float(s.tokens) for s in self._counts().values()), default=0))

    def layer_distinct_experts(self) -> dict[int, dict[str, float]]:
        """Distinct experts per decode step, per MoE layer that counted them (the layers a distinct
        policy runs in, or every layer with `context.count_steps`): {"mean", "max", "steps"}."""
        out = {}
        for index, s in self._counts().items():
            steps = float(s.steps)
            if steps:
                out[index] = {"mean": float(s.distinct) / steps, "max": int(s.distinct_max), "steps": int(steps)}
        return out

    def distinct_experts_per_step(self) -> float | None:
        """Mean over decode steps and counting layers of the distinct experts a step loads."""
        layers = self.layer_distinct_experts()
        return sum(v["mean"] for v in layers.values()) / len(layers) if layers else None

    def max_distinct_experts_per_step(self) -> int | None:
        """The most distinct experts any counting layer loaded in any one step."""
        return max((v["max"] for v in self.layer_distinct_experts().values()), default=None)

    def top1_outside_rate(self) -> dict[int, float]:
        """Per MoE layer where the distinct policy ran: the share of its real tokens whose own top-1
        expert fell outside the step's chosen set."""
        return {index: float(s.top1_outside) / float(s.chooser_tokens)
                for index, s in self._counts().items() if float(s.chooser_tokens)}


def apply_plan(model: nn.Module, plan: Plan, renormalize: bool | None = None) -> PlanHandle:
    """Install `plan` on `model` in place; returns a handle that restores the model on exit.

    renormalize: None keeps each family's native combine; True/False forces renormalising the kept
    weights (or not) for every layer.

    `plan` is a Plan, a plan file's path (loaded with Plan.load, so its substitute comes with it) or a
    plan document as a dict (Plan.from_dict).
    """
    return apply_plans(model, [plan], renormalize, _caller="apply_plan")


def as_plan(plan, function: str = "apply_plan") -> Plan:
    """A Plan from what the public functions accept for one: a Plan, a plan file's path, or a plan
    document (dict); anything else is refused."""
    import os

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    raise AllocMoeError(f"{function}: plan must be a Plan, a plan file's path or a plan document (dict), got "
                        f"{repr(plan)[:60]} ({type(plan).__name__}); make one with allocmoe.allocate or "
                        "allocmoe.static_plan, or give a path")


def apply_plans(model: nn.Module, plans: list[Plan], renormalize: bool | None = None, *,
                _caller: str = "apply_plans") -> PlanHandle:
    """Install several plans at once: row r of a batch follows plan `handle.context.row_plans[r]`
    (all rows follow plan 0 while `row_plans` is None). `handle.add_plan` installs more later.
    Each plan may be a Plan, a plan file's path or a plan document (as for apply_plan)."""
    from ..core.config import check_argument, check_model_argument

    check_model_argument(_caller, model)
    check_argument(_caller, "renormalize", renormalize, bool | None)
    if isinstance(plans, (Plan, str, dict)) or not isinstance(plans, (list, tuple)):
        raise AllocMoeError(f"{_caller}: plans must be a list of plans, got {type(plans).__name__}; give "
                            "[plan, ...] (or apply_plan(model, plan) for one)")
    if not plans:
        raise AllocMoeError("apply_plans needs at least one plan; give [plan, ...]")
    plans = [as_plan(plan, _caller) for plan in plans]
    adapter = adapter_for_model(model)
    for plan in plans:
        check_plan(plan, model)
    layers = adapter.moe_layers(model)
    installed = active_handle(model)
    if installed is not None and installed._model_id != id(model):
        raise AllocMoeError(_COPIED)
    if any(_MARK in layer.router.__dict__ for layer in layers):
        raise AllocMoeError("a plan is already applied to this model; remove its handle first (`handle.remove()` "
                            "or leave its `with` block), or install several plans together with apply_plans "
                            "or handle.add_plan")
    if any(_replaced(module) for layer in layers for module in (layer.router, layer.experts)):
        raise AllocMoeError("this model's MoE layers already run a replaced forward (inside routed_experts_off "
                            "or allocmoe_experts?); apply the plan outside that block")
    ctx = RoutingContext()
    stats = {layer.index: LayerStats() for layer in layers}
    k_orig = adapter.k_orig()
    policies = {layer.index: [plan.layers[layer.index] for plan in plans] for layer in layers}
    for layer in layers:
        for policy in policies[layer.index]:
            policy.check(k_orig)
    means = {layer.index: [layer_substitute(plan, layer) for plan in plans] for layer in layers}
    for layer in layers:
        pending: dict = {}          # the layer's substitute, handed from its router to its experts in a pass
        _set_forward(layer.router, router_forward(adapter, layer, policies[layer.index], k_orig, ctx,
                                                   stats[layer.index], renormalize, means[layer.index], pending))
        _set_forward(layer.experts, experts_forward(layer.experts, pending))
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
    handle = PlanHandle(model, list(plans), layers, ctx, stats, hook, policies, k_orig, means)
    model.__dict__[_HANDLE] = handle
    return handle


def active_handle(model: nn.Module) -> PlanHandle | None:
    """The handle of the plans installed on `model`, if any (so code handed a patched model can
    count what it spends instead of assuming the full budget)."""
    return model.__dict__.get(_HANDLE)


def static_plan(model: nn.Module, k_per_layer: dict[int, int] | list[int], method: str = "manual") -> Plan:
    """A plan of static top-k per layer: a list (or tuple) of one k per MoE layer, in MoE-layer order, or
    {MoE-layer index: k} naming every MoE layer; each k a whole number in 1..K (the model's top-k)."""
    from ..core.config import check_argument, check_model_argument

    check_model_argument("static_plan", model)
    check_argument("static_plan", "method", method, str)
    fingerprint = model_fingerprint(model)
    k_per_layer = _per_layer("static_plan", "k_per_layer", k_per_layer, fingerprint["moe_layers"], 1,
                             fingerprint["k_orig"], "the model's top-k K")
    layers = {index: StaticTopK(k) for index, k in k_per_layer.items()}
    return Plan(model=fingerprint, layers=layers, method=method, budget=float(sum(k_per_layer.values())))


def distinct_plan(model: nn.Module, max_experts: int | dict[int, int] | list[int], k_floor: int = 1,
                  method: str = "distinct") -> Plan:
    """A plan of the distinct-expert budget: at most `max_experts` distinct experts per decode step
    in each MoE layer (one number for all, a list in MoE-layer order, or {layer index: M}). Its
    budget is the full L * K_orig: the plan bounds experts per step, not activations per token."""
    from ..core.config import check_argument, check_model_argument

    check_model_argument("distinct_plan", model)
    check_argument("distinct_plan", "method", method, str)
    fingerprint = model_fingerprint(model)
    indices = fingerprint["moe_layers"]
    check_argument("distinct_plan", "k_floor", k_floor, int)
    if not 1 <= k_floor <= fingerprint["k_orig"]:
        raise AllocMoeError(f"distinct_plan: k_floor {k_floor} is outside 1..{fingerprint['k_orig']} (the model's "
                            f"top-k K); give a whole number in that range")
    if isinstance(max_experts, int) and not isinstance(max_experts, bool):
        max_experts = {index: max_experts for index in indices}
    max_experts = _per_layer("distinct_plan", "max_experts", max_experts, indices, 1, fingerprint["num_experts"],
                             "the model's experts per layer")
    layers = {index: DistinctExperts(m, k_floor) for index, m in max_experts.items()}
    for policy in layers.values():
        policy.check(fingerprint["k_orig"])
    return Plan(model=fingerprint, layers=layers, method=method,
                budget=float(fingerprint["num_moe_layers"] * fingerprint["k_orig"]))


def _per_layer(function: str, name: str, value, indices: list[int], low: int, high: int, what: str) -> dict[int, int]:
    """{MoE-layer index: whole number in low..high} from a list in MoE-layer order or a dict naming every
    MoE layer; anything else (a float, a bool, a short list, an unknown layer) is refused."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(indices):
            raise AllocMoeError(f"{function}: {name} has {len(value)} entries but the model has {len(indices)} MoE "
                                f"layers {indices}; give one per MoE layer")
        value = dict(zip(indices, value))
    elif not isinstance(value, dict):
        raise AllocMoeError(f"{function}: {name} must be a list of one whole number per MoE layer or a dict "
                            f"{{layer index: number}}, got {repr(value)[:60]} ({type(value).__name__}); give "
                            f"{len(indices)} whole numbers")
    if sorted(value, key=repr) != sorted(indices, key=repr):
        raise AllocMoeError(f"{function}: {name} names layers {sorted(value, key=repr)} but the model's MoE layers "
                            f"are {indices}; give one entry for each")
    for index, k in value.items():
        if not isinstance(k, int) or isinstance(k, bool) or not low <= k <= high:
            raise AllocMoeError(f"{function}: {name} for MoE layer {index} is {k!r}; give a whole number in "
                                f"{low}..{high} ({what})")
    return dict(value)


class _experts_forward_swapped:
    """Context manager: every MoE layer's experts module runs `forward` (bound to it) until exit."""

    def __init__(self, model: nn.Module, forward):
        self._experts = [layer.experts for layer in adapter_for_model(model).moe_layers(model)]
        self._forward = forward

    def __enter__(self):
        for experts in self._experts:
            _set_forward(experts, self._forward.__get__(experts))
        return self

    def __exit__(self, *exc):
        for experts in self._experts:
            _restore_forward(experts)


def _hooked(module: nn.Module) -> bool:
    """Does accelerate's device hook (device_map, offload) wrap this module's forward?"""
    return hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__


def _set_forward(module: nn.Module, forward) -> None:
    """Make `module` run `forward`. Under an accelerate hook that is the `_old_forward` the hook calls, so
    the hook still moves weights and inputs to their device around it (multi-GPU device_map, offload)."""
    if _hooked(module):
        module.__dict__.setdefault(_SAVED, module._old_forward)
        module._old_forward = forward
    else:
        module.forward = forward


def _restore_forward(module: nn.Module) -> None:
    if _SAVED in module.__dict__:
        module._old_forward = module.__dict__.pop(_SAVED)
    elif "forward" in module.__dict__ and not _hooked(module):
        del module.forward


def _replaced(module: nn.Module) -> bool:
    """Is something else (routed_experts_off, allocmoe_experts) already running in place of forward?"""
    return _SAVED in module.__dict__ or ("forward" in module.__dict__ and not _hooked(module))


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
