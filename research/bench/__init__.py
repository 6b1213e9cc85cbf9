"""Benchmarks (`python -m research bench modules|step|threads|vocab|gpu|...`)."""
