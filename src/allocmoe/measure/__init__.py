"""Measuring a plan: perplexity and lm-eval tasks, latency benches, routing analyses, sweeps and their
reports."""
