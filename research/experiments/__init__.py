"""The sweeps, maps and analyses behind the paper's figures and our results (RESULTS.md,
PARETO.md)."""
