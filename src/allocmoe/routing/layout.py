"""A live model's MoE layout, as plans and profiles record it: the fingerprint (family, MoE layer
indices, expert count, K_orig) read through the model's adapter, and the check of a plan against a
model. core/plan.py keeps plans as data and checks them against a fingerprint it is given; reading
one off a model needs the adapters, so it is done here, a floor above."""

from __future__ import annotations

import os
from typing import Any

from ..errors import AllocMoeError

from ..core.budget import standin_equivalent
from ..core.plan import Plan
from .adapters import adapter_for_model


def model_fingerprint(model) -> dict[str, Any]:
    """What a plan or profile must match: family, MoE layer indices, expert count and K_orig."""
    adapter = adapter_for_model(model)
    layers = [layer.index for layer in adapter.moe_layers(model)]
    return {"model_type": model.config.model_type, "num_moe_layers": len(layers),
            "num_experts": adapter.num_experts(), "k_orig": adapter.k_orig(), "moe_layers": layers}


def hidden_size(model) -> int | None:
    """The model's hidden size, which a plan's expert means must have (None if its config does not say)."""
    return getattr(model.config, "hidden_size", None)


def check_plan(plan: Plan, model) -> None:
    """Refuse `plan` unless it was made for `model` (a loaded model or its weightless skeleton); a plan
    that does not record its stand-ins' cost gets it from the model (`with_standin_costs`)."""
    plan.check_model(model_fingerprint(model), hidden_size(model))
    with_standin_costs(plan, model)


def load_plan(path: str | os.PathLike, model) -> Plan:
    """Load a plan file and check it was made for `model`; a plan written before its stand-ins' cost was
    recorded gets it from the model (`with_standin_costs`)."""
    return with_standin_costs(Plan.load(path, model_fingerprint(model), hidden_size(model)), model)


def with_standin_costs(plan: Plan, model) -> Plan:
    """`plan` with `standins` (each stand-in's cost per skipped slot) read off `model` where the plan does
    not record them; the plan itself, changed in place."""
    if plan.standins is None and plan.means is not None:
        plan.standins = standin_costs(model, plan.means)
    return plan


def expert_weights(model) -> int:
    """One routed expert's weight multiply-adds per token: the elements of its weight matrices (the
    experts module's parameters of 3 or more dims, [E, ...] each, over E; biases are adds, not counted).
    3 x H x I for a gated expert. Read off the first MoE layer (every MoE layer of a family has the same)."""
    layer = adapter_for_model(model).moe_layers(model)[0]
    weights = [p for p in layer.experts.parameters() if p.dim() >= 3]
    if not weights:
        raise AllocMoeError(f"the {model.config.model_type} model's experts hold no [E, ...] weight tensors; "
                            "allocmoe cannot count what an expert costs")
    return sum(p[0].numel() for p in weights)


def standin_costs(model, means) -> dict[int, float]:
    """Per MoE layer that carries a stand-in under `means` (core/means.py ExpertMeans), what one costs per
    skipped slot in activation-equivalents (core/budget.py standin_equivalent): rank r where the layer
    has a linear term, 0 (the means alone) where it has only a mean."""
    if means is None:
        return {}
    weights, hidden = expert_weights(model), int(model.config.hidden_size)
    linear = means.linear or {}
    return {index: standin_equivalent(hidden, weights, linear[index].rank if index in linear else 0)
            for index in means.means}
