"""allocmoe: budget-aware expert activation (Alloc-MoE) for Mixture-of-Experts language models."""

from .version import __version__
from .routing.adapters import supported_model_types
from .routing.apply import PlanHandle, apply_plan, distinct_plan, static_plan
from .routing.experts import pack_experts
from .core.budget import Budget
from .errors import AllocMoeError
from .scoring import PerplexityConfig, evaluate_perplexity
from .calibrate.methods import AllocateConfig, allocate
from .calibrate.distinct import DistinctConfig, allocate_distinct, distinct_profile
from .measure.evaluate.run import evaluate_model
from .models import load_model
from .core.plan import Plan
from .routing.layout import model_fingerprint
from .core.policies import AllocT, DistinctExperts, NaeeSkip, StaticTopK, TopP, select_experts
from .calibrate.profile import ProfileConfig, load_profile, profile_sensitivity
from .serve.generate import generate
from .pipelines.sweep import SweepConfig, sweep
from .texts import read_text

__all__ = [
    "__version__", "AllocMoeError", "AllocT", "AllocateConfig", "Budget", "DistinctConfig", "DistinctExperts", "NaeeSkip", "PerplexityConfig", "Plan",
    "PlanHandle", "ProfileConfig", "StaticTopK", "SweepConfig", "TopP", "allocate", "allocate_distinct", "apply_plan",
    "distinct_plan", "distinct_profile",
    "evaluate_model", "evaluate_perplexity", "generate", "load_model", "load_profile", "model_fingerprint",
    "pack_experts", "profile_sensitivity", "read_text",
    "select_experts", "static_plan", "supported_model_types", "sweep",
]
