"""Names and keys shared by the pareto map's modules: point labels, budget caps, timing keys."""

from __future__ import annotations

from typing import Any

Point = tuple[float, float]  # (cost, loss)

# "best at ≤ P" caps: Δparams (M) and step time as a multiple of the raw GPT's step
PARAM_CAPS_M = (1.5, 3.0, 5.0, 10.0, 13.0)
STEP_CAPS_X = (1.25, 1.5, 2.0, 3.0, 5.0)
LABELS = {
    "raw": "raw GPT",
    "engram": "Engram",
    "tngram": "TN-gram",
    "oe": "Over-Encoding",
    "longcat": "Over-Encoding (LongCat n4 k4)",
    "dense": "dense (wider GPT)",
    "tngram-lean": "TN-gram lean",
    "tngram-sum": "TN-gram sum-K/V",
    "tngram-shared": "TN-gram shared",
    "tngram-hybrid": "TN-gram + hashed",
    "tngram-hsum": "TN-gram sum + hashed",
    "pkm": "product keys",
    "stem": "STEM",
    "ple": "per-layer embeddings",
    "engram-iso": "Engram (E 32), iso",
    "tngram-sum-iso": "TN-gram sum-K/V, iso",
    "pkm-iso": "product keys, iso",
    "stem-iso": "STEM, iso",
    "ple-iso": "per-layer embeddings, iso",
}


def point_key(family: str, size: Any, corpus: str = "") -> str:
    """The timing key of a point: family and size, plus "@V" for a corpus tokenised with another
    vocabulary ("default@8192"): the step depends on the vocabulary, not on the text."""
    key = family if size is None else f"{family}-{size}"
    return key + ("@" + corpus.partition("@")[2] if "@" in corpus else "")


def name_of(p: dict[str, Any]) -> str:
    return LABELS.get(p["family"], p["family"]) + ("" if p["size"] is None else f" ({p['size']})")
