"""Benchmarks (`tngram bench modules|step|data`); never imported by the library or the tests."""
