"""Quality evaluation: token-level perplexity (and, with the [eval] extra, lm-evaluation-harness)."""

from .perplexity import PerplexityConfig, PerplexityResult, evaluate_perplexity, tokenize_windows

__all__ = ["PerplexityConfig", "PerplexityResult", "evaluate_perplexity", "tokenize_windows"]
