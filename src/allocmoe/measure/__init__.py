"""Measuring a plan: quality (evaluate/: evaluate_model, lm-eval tasks, paired comparison), latency
benches, routing analyses, and the sweep's report. Perplexity itself is scored by allocmoe.scoring;
the sweep, which calibrates as well as measures, is a pipeline above both (allocmoe.pipelines)."""
