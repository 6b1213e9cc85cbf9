"""The doc-block generators: every generated table of the docs, rendered from research/results/."""
