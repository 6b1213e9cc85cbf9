"""The lab beside the library: the experiments, benches and doc-table generators that produce
tngram's evidence (research/results/, research/*.md). Not installed by pip; run from a clone's root
with `python -m research COMMAND` (see research/README.md). It imports tngram's public names;
tngram never imports it (an import-linter contract in `make test`)."""
