"""How large a memory is against the model it goes into, before it is built.

The memory is built once on the meta device (no storage, no initialisation: milliseconds even
at a 128,256-token vocabulary) and its parameters are counted. A memory larger than the model
(`MAX_RATIO`) gets one warning saying its size, the model's, how much of it is lookup tables,
and a size for about a tenth of the model (`TARGET_RATIO`): the largest cp_rank (TN-gram),
table_budget per order (Engram) or table_rows (Over-Encoding) within it, as a config to copy.

At a large vocabulary (`LARGE_VOCAB` and up) the paper's TN-gram gets a cp_rank far below V, where
it was measured behind Engram (research/results/vocab-regime.json): there the warning (and a
`VocabularyRegimeWarning` for a TN-gram of any size with R/V below `REGIME_RV`) names what to use
instead, with the measured numbers behind it (`regime_note`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from tngram.memory.tngram import TNGramConfig

MAX_RATIO = 1.0
TARGET_RATIO = 0.1
LARGE_VOCAB = 8192
REGIME_RV = 0.25  # R/V below which the paper's TN-gram was measured behind Engram
TABLE_FIELDS = {  # what sets a memory's table size, per kind
    "tngram": "cp_rank",
    "tngram-variant": "cp_rank",
    "engram": "table_budget",
    "oe": "table_rows",
}


class MemorySizeWarning(UserWarning):
    """add_memory: the memory is larger than the model (warnings.filterwarnings can mute it)."""


class VocabularyRegimeWarning(UserWarning):
    """add_memory: a paper TN-gram whose cp_rank is far below a large vocabulary."""


def memory_size(cfg: Any, d_model: int, vocab: int, layer_ids: tuple[int, ...]) -> tuple[int, int]:
    """(parameters, table parameters) the memory of `cfg` adds at `layer_ids` (one memory for
    an embedding memory), counted on a meta-device build."""
    total = tables = 0
    for k, i in enumerate(layer_ids or (0,)):
        with torch.device("meta"):
            mod = cfg.build(
                d_model=d_model, vocab_size=vocab, layer_id=i, layer_ids=layer_ids or (0,)
            )
        n = sum(p.numel() for p in mod.parameters())
        t = sum(p.numel() for p in getattr(mod, "table_parameters", list)())
        shared = k > 0 and getattr(cfg, "share_factors", False)  # one set of factors: once
        total += n - (t if shared else 0)
        tables += 0 if shared else t
    return total, tables


def suggestion(
    cfg: Any, d_model: int, vocab: int, ids: tuple[int, ...], total: int, model_params: int
) -> str:
    """A size for about TARGET_RATIO of the model, as a config: TN-gram's largest cp_rank,
    Engram's largest table_budget (the same for each order), Over-Encoding's largest table_rows
    within it (found by bisection on meta-device counts); for other kinds the factor to scale
    the tables by."""
    target = TARGET_RATIO * model_params
    kind = getattr(cfg, "kind", "")
    if kind in ("tngram", "tngram-variant") and dataclasses.is_dataclass(cfg):
        tn = cast("TNGramConfig", cfg)
        make = lambda r: dataclasses.replace(tn, cp_rank=r)  # noqa: E731
        r = _largest(make, int(tn.cp_rank), d_model, vocab, ids, target)
        return f"{type(cfg).__name__}(cp_rank={r}) for about {TARGET_RATIO:.0%} of the model"
    about = f"for about {TARGET_RATIO:.0%} of the model"
    conf: Any = cfg  # an EngramConfig / OverEncodingConfig below (frozen dataclasses)
    if kind in ("engram", "oe"):
        if kind == "engram":  # one per-head budget per order 2..N, the same for each
            n, top, other = int(conf.max_ngram) - 1, max(conf.budgets(vocab)), "n_embed_per_ngram"
            value: Any = lambda b: (b,) * n  # noqa: E731
        else:
            top, other = conf.table_rows or 5 * vocab, "slice_dim"
            value = lambda b: b  # noqa: E731
        field = TABLE_FIELDS[kind]
        grow: Any = lambda b: dataclasses.replace(conf, **{field: value(b)})  # noqa: E731
        best = _largest(grow, top, d_model, vocab, ids, target)
        over = memory_size(grow(best), d_model, vocab, ids)[0] > target
        hint = f" (smaller tables alone do not get there: lower {other} too)" if over else ""
        return f"{type(cfg).__name__}({field}={value(best)}) {about}{hint}"
    field = TABLE_FIELDS.get(kind, "its table size")
    return f"tables about {target / total:.2g}x this size ({field}) {about}"


def _largest(
    make: Any, hi: int, d_model: int, vocab: int, ids: tuple[int, ...], target: float
) -> int:
    """The largest size in [1, hi] whose memory make(size) has <= target parameters (else 1)."""
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if memory_size(make(mid), d_model, vocab, ids)[0] <= target:
            lo = mid
        else:
            hi = mid
    return max(lo, 1)


def regime_note(cfg: Any, d_model: int, vocab: int, ids: tuple[int, ...], model_params: int) -> str:
    """What to use instead of the paper's TN-gram at a LARGE_VOCAB+ vocabulary ("" otherwise):
    Engram, with the measured numbers, and the TN-gram that keeps R/V' = 1 (TNGramHashedConfig at
    the largest cp_rank = factor_rows within TARGET_RATIO of the model)."""
    if getattr(cfg, "kind", "") not in ("tngram", "tngram-variant") or vocab < LARGE_VOCAB:
        return ""
    from tngram.memory.tngram_hashed import TNGramHashedConfig

    base = TNGramHashedConfig(max_ngram=cfg.max_ngram, cp_rank=1, factor_rows=1, pad_id=cfg.pad_id)
    make = lambda r: dataclasses.replace(base, cp_rank=r, factor_rows=r)  # noqa: E731
    r = _largest(make, vocab, d_model, vocab, ids, TARGET_RATIO * model_params)
    return (
        f"at a {vocab:,}-token vocabulary cp_rank={cfg.cp_rank} is R/V = "
        f"{cfg.cp_rank / vocab:.2g}, "
        f"where the paper's TN-gram was measured behind Engram at <= Engram's parameters (+0.012 "
        f"and +0.025 nats at V 8,192, R/V 0.09 and 0.04), and so were TN-gram with hashed factor "
        f"rows at R/V' = 1 (+0.0066 nats at V 4,096, 2 seeds; +0.020 at V 32,768, 1 seed) and "
        f"TN-gram sum + hashed at V 32,768 (+0.0087 pooled, Engram ahead in 4 of 5 seeds; "
        f"research/results/vocab-regime.json): use EngramConfig; "
        f"TNGramHashedConfig(cp_rank={r}, factor_rows={r}) is the TN-gram that keeps R/V' = 1 at "
        f"that size"
    )


def warn_if_large(
    model: nn.Module, cfg: Any, d_model: int, vocab: int, ids: tuple[int, ...]
) -> None:
    """One MemorySizeWarning when the memory would have more parameters than the model."""
    total, tables = memory_size(cfg, d_model, vocab, ids)
    model_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    note = regime_note(cfg, d_model, vocab, ids, model_params)
    if total <= MAX_RATIO * model_params:
        if note and cfg.cp_rank < REGIME_RV * vocab:
            warnings.warn(f"add_memory: {note}", VocabularyRegimeWarning, stacklevel=3)
        return
    where = f"at {len(ids)} layer{'s' if len(ids) > 1 else ''}" if ids else "at the embedding"
    warnings.warn(
        f"add_memory: the memory has {total:,} parameters ({where}; {tables / total:.0%} lookup "
        f"tables, which grow with the {vocab:,}-token vocabulary), {total / model_params:.1f}x the "
        f"model's {model_params:,}: building and training it costs that much memory; use "
        f"{suggestion(cfg, d_model, vocab, ids, total, model_params)} (MemoryTrainer's "
        "memory_update='rowwise' keeps about half the tables' optimiser state)"
        + (f"; {note}" if note else ""),
        MemorySizeWarning,
        stacklevel=3,
    )
