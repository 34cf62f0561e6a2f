"""A plan on a live model: family adapters (found by model_type), installing plans at the router
(`apply_plan`), and expert execution that skips what a plan drops."""
