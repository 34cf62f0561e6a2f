"""A live model's MoE layout, as plans and profiles record it: the fingerprint (family, MoE layer
indices, expert count, K_orig) read through the model's adapter, and the check of a plan against a
model. core/plan.py keeps plans as data and checks them against a fingerprint it is given; reading
one off a model needs the adapters, so it is done here, a floor above."""

from __future__ import annotations

import os
from typing import Any

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
    """Refuse `plan` unless it was made for `model` (a loaded model or its weightless skeleton)."""
    plan.check_model(model_fingerprint(model), hidden_size(model))


def load_plan(path: str | os.PathLike, model) -> Plan:
    """Load a plan file and check it was made for `model`."""
    return Plan.load(path, model_fingerprint(model), hidden_size(model))
