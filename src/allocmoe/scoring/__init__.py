"""Scoring a model on text: token-level perplexity over non-overlapping windows. A primitive below
calibration (profiles, allocation searches and the distinct-expert budget score with it) and below
measurement (`allocmoe eval`, sweeps, analyses)."""

from .perplexity import PerplexityConfig, PerplexityResult, evaluate_perplexity, tokenize_windows

__all__ = ["PerplexityConfig", "PerplexityResult", "evaluate_perplexity", "tokenize_windows"]
