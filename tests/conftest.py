"""Fixtures shared by several test files."""
from __future__ import annotations

import pytest


@pytest.fixture
def fresh_lookup_choice(monkeypatch):
    """A process state in which no lookup implementation has been chosen or self-checked yet, and
    none is forced by TNGRAM_LOOKUP_IMPL; returns the monkeypatch so a test can patch more."""
    import tngram.kernels.choice as choice
    monkeypatch.setattr(choice, "_CHOICE", {})
    monkeypatch.setattr(choice, "SELF_CHECKS", {})
    monkeypatch.delenv("TNGRAM_LOOKUP_IMPL", raising=False)
    return monkeypatch
