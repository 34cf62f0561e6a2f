"""Adapter registry: `model_type` -> adapter class. Adding a family is adding one small file."""

from __future__ import annotations

from ...errors import AllocMoeError
from .base import MoEAdapter

ADAPTERS: dict[str, type[MoEAdapter]] = {}

# Families we know and refuse, with the reason a user needs.
REFUSED = {
    "phimoe": "PhiMoE's sparsemixer router ignores top_k (it is hard-wired to top-2)",
    "jetmoe": "JetMoE uses an older MoE code path without a separate router module",
    "dbrx": "DBRX uses an older MoE code path without a separate router module",
}


def register_adapter(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    for model_type in cls.model_types:
        ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_class(model_type: str | None) -> type[MoEAdapter]:
    """The adapter class for `model_type`; refuses, with the reason and the supported list, any other
    (checkable from config.json's model_type alone, before transformers or any weights are touched)."""
    cls = ADAPTERS.get(model_type)  # type: ignore[arg-type]
    if cls is None:
        why = REFUSED.get(model_type, "it is not a supported MoE architecture")  # type: ignore[arg-type]
        raise AllocMoeError(f"unsupported architecture {model_type!r} ({why}); "
                            f"supported: {', '.join(supported_model_types())}")
    return cls


def adapter_for_config(config) -> MoEAdapter:
    return adapter_class(getattr(config, "model_type", None))(config)


def adapter_for_model(model) -> MoEAdapter:
    config = getattr(model, "config", None)
    adapter = adapter_for_config(config)
    if not adapter.moe_layers(model):
        raise AllocMoeError(f"model of type {config.model_type!r} has no MoE layers that allocmoe can find")
    return adapter
