"""The pure core: budgets, plans, selection policies and the DP solver. No model, no torch module state;
everything here is tested on numbers alone."""
