"""Deploying a plan: streaming generation (`generate`) and an OpenAI-compatible server (`app`),
both on one continuous-batching engine whose rows may follow different plans."""

from .engine import Engine, Request
from .generate import GenerationSummary, TextStream, generate
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationSummary", "Request", "SamplingParams", "TextStream", "generate"]
