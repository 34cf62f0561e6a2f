"""Quality evaluation of a plan: `evaluate_model` (run.py), lm-evaluation-harness tasks with the
[eval] extra (harness.py) and paired comparisons (paired.py). Perplexity itself is scored by
allocmoe.scoring, below calibration and measurement alike."""
