"""Cells of the GPU results tables: an item's number, or why there is none."""

from __future__ import annotations

from typing import Any


def ok(r: Any) -> bool:
    """The item ran and has numbers (neither skipped nor an error)."""
    return isinstance(r, dict) and "skipped" not in r and "error" not in r


def cell(r: Any, field: str, spec: str, scale: float = 1.0) -> str:
    """A number of an item, or why there is none (skipped / error / not run)."""
    if r is None:
        return "not run"
    if "skipped" in r:  # the reason's first word: the time budget, or memory (bench.gpu)
        return "skipped (memory)" if str(r["skipped"]).startswith("memory") else "skipped (budget)"
    if "error" in r:
        return "error"
    v = r.get(field)
    return "–" if v is None else format(v * scale, spec)


def ratio(a: Any, b: Any) -> str:
    """a's median ms over b's, or a dash when either has none."""
    if ok(a) and ok(b):
        return f"{a['median_ms'] / b['median_ms']:.2f}×"
    return "–"
