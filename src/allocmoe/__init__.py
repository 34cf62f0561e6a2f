"""allocmoe: budget-aware expert activation (Alloc-MoE) for Mixture-of-Experts language models."""

__version__ = "0.1.0"

from .adapters import supported_model_types
from .apply import PlanHandle, apply_plan, static_plan
from .budget import Budget
from .errors import AllocMoeError
from .models import load_model
from .plan import Plan, model_fingerprint
from .policies import AllocT, NaeeSkip, StaticTopK, TopP, select_experts

__all__ = [
    "__version__", "AllocMoeError", "AllocT", "Budget", "NaeeSkip", "Plan", "PlanHandle", "StaticTopK",
    "TopP", "apply_plan", "load_model", "model_fingerprint", "select_experts", "static_plan",
    "supported_model_types",
]
