"""Model-family adapters, found by `model_type` through the registry."""

from . import deepseek, softmax_topk, topk_softmax  # noqa: F401  (register the families)
from .base import MoEAdapter, MoELayer, RouterScores
from .registry import adapter_for_config, adapter_for_model, register_adapter, supported_model_types

__all__ = ["MoEAdapter", "MoELayer", "RouterScores", "adapter_for_config", "adapter_for_model",
           "register_adapter", "supported_model_types"]
