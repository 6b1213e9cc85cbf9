"""tngram: tensorized n-gram memories (TN-gram), Engram and Over-Encoding for GPT language models.

Importing the package does no work; heavy modules load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "build_model"]


def build_model(recipe_name: str, **overrides):
    """Build the model of a named recipe (see `tngram recipes`): forward(ids (B, T)) -> logits (B, T, V)."""
    from tngram.recipes import build_model as _build

    return _build(recipe_name, **overrides)
