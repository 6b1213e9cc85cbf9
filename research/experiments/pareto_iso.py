"""Pay for the memory with the backbone: the iso-parameter backbone and the map's "= total
parameters" and "<= step time" views.

`iso_backbone(model)`: the same GPT with every block's MLP narrowed so that backbone + memory
has at most the raw GPT's total parameters. Shapes: the FFN width first (what deepseek-ai/Engram
#20 shrank); the MLP hidden width is the largest multiple of `multiple` (16: matrix shapes stay
aligned to bf16 tensor-core tiles, and one step at `mini` is 4 x 2 x 128 x 16 = 16,384
parameters, 2.8% of the raw GPT) whose total is <= the raw GPT's; attention, the embedding and
the depth are kept. Each block's MLP holds
2 * n_embd * width parameters, so the total is linear in the width:

    total(w) = total(w0) + 2 * n_embd * n_layer * (w - w0)
    w*       = multiple * floor((raw_total - total(w0) + 2 d L w0) / (2 d L multiple))

When even a width of `multiple` does not pay for the memory, the function refuses (one line):
the memory is larger than the FFN can give (at `mini`, 4 blocks x 2 x 128 x 256 = 262,144 MLP
parameters, so at most 245,760 of memory; Engram at the recipe's width needs more for its K/V
projections alone).

The "<= step time" view needs no runs of its own: every point's step is measured
(`bench_points`), and a point enters the view at step <= the raw GPT's times a cap
(`points_within_step`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tngram.common import TngramError

MLP_MULTIPLE = 16

# issue 40's families (mini only: their recipes are mini-pkm, mini-stem, mini-ple), at the map's
# common Δparams targets (1.1, 2.2, 4.3, 8.7, 12 M; tests/test_pareto_iso.py), at the recipes'
# table lr (the embedding's; not tuned): product keys (n_keys: n_keys^2 slots per layer), STEM
# (its FFN width), per-layer embeddings in every block (ple_dim)
TOKEN_SIZES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "pkm": ("pkm", "n_keys", (64, 92, 129, 184, 216)),
    "stem": ("stem", "hidden", (432, 864, 1680, 3392, 4688)),
    "ple": ("ple", "ple_dim", (216, 432, 840, 1696, 2344)),
}
# "= total parameters": each family at three sizes near 1/4, 1/2 and 3/4 of the mini GPT's MLP
# parameters (65,536, 131,072, 196,608 of 262,144), on a backbone whose MLP width is shrunk to
# keep the raw GPT's total (iso_backbone). Engram at its recipe width needs more than that for its
# K/V alone, so it enters at n_embed_per_ngram 32; the TN-gram variant is tngram-sum (one R-wide
# K/V input), the one whose K/V fits at small R; Engram and TN-gram at the map's tuned table lr
ISO_SIZES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "engram": ("engram", "table_budget", (50, 162, 400)),
    "tngram-sum": ("tngram", "cp_rank", (6, 12, 18)),
    "pkm": ("pkm", "n_keys", (11, 19, 24)),
    "stem": ("stem", "hidden", (24, 48, 72)),
    "ple": ("ple", "ple_dim", (12, 24, 36)),
}
ISO_VARIANTS: dict[str, dict[str, Any]] = {"engram": {"n_embed_per_ngram": 32}}
METHODS = ("raw", "engram", "tngram", "pkm", "stem", "ple")  # the recipes view_specs builds on


def iso_backbone(model: Any, raw: Any = None, multiple: int = MLP_MULTIPLE) -> Any:
    """GPTConfig `model` (with a memory) -> the same config with `mlp_hidden` set to the largest
    multiple of `multiple` whose total parameters are <= those of `raw` (default: `model`
    without memory and at its recipe width). TngramError when no width >= `multiple` fits."""
    from tngram.model.gpt import param_counts

    if multiple < 1:
        raise TngramError(f"multiple must be >= 1, got {multiple}")
    raw = replace(model, memory=None, mlp_hidden=0) if raw is None else raw
    target = param_counts(raw)["total_params"]
    w0 = model.mlp_width()
    now = param_counts(model)["total_params"]
    per_unit = 2 * model.n_embd * model.n_layer  # parameters per unit of MLP width
    fixed = now - per_unit * w0  # everything but the MLPs
    width = multiple * ((target - fixed) // (per_unit * multiple))
    if width < multiple:
        mem = now - param_counts(replace(model, memory=None))["total_params"]
        raise TngramError(
            f"the memory ({mem:,} parameters) is larger than the backbone's MLPs can pay for: "
            f"an MLP width of {multiple} already gives {fixed + per_unit * multiple:,} total "
            f"parameters > the raw GPT's {target:,}"
        )
    return replace(model, mlp_hidden=int(width))


def points_within_step(points: list[dict[str, Any]], raw_step_ms: float, cap: float) -> list:
    """The points (dicts with "step_ms") whose measured step is <= cap x the raw GPT's."""
    return [p for p in points if p.get("step_ms") is not None and p["step_ms"] <= cap * raw_step_ms]
