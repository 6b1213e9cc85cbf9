"""`python -m research experiment pareto`: every memory family on one map of loss vs Δparams (vs
step time).

Each family is swept over its size knob across one common Δparams range (at `mini`: about
1.1, 2.2, 4.3, 8.7 and 12 M; `SIZES`), at its own table lr tuned once on the tuning corpus
(`literature`) and then fixed:

    engram    Engram, per-head table rows (`table_budget`; the recipe's is 5 V = 5120)   tuned:
    table lr x 4
    tngram    TN-gram, CP rank                                          tuned: table lr x 2
    oe        Over-Encoding (N 5, 2 slices), slice-table rows           tuned here (`tune_table_lr`)
    longcat   Over-Encoding at LongCat's settings (n 4, k 4, averaged fusion), slice-table rows;
              trains at Over-Encoding's tuned factor (one tuning per fusion rule, not per preset)
    dense     the raw GPT grown wider (n_embd): "spend it on the backbone instead"; no table, the
              recipe's learning rates (not tuned)
    tngram-lean / -sum / -shared / -hybrid
              TN-gram variants beyond the paper (`VARIANTS`: no RMSNorm and no absorption; orders
              summed before one K/V; factors shared by both memory layers; R 88 plus Engram-style
              hashed orders 2..5 sized by `hash_budget`); TN-gram's table lr, the hybrid Engram's
    tngram-hsum
              TN-gram R 64 with its orders summed + hashed orders 2..5 (104 wide), each size the
              largest `hash_budget` within the Engram point's Δparams; Engram's table lr
    raw       the raw GPT (Δparams 0), the reference point

The confirmation (`CONFIRM`): the variant chosen on the literature screen (tngram-hsum) and Engram
at size index 2 (the screened size), then at index 1 (added before its extra seeds ran, after the
map showed it ahead there), get seeds up to CONFIRM_SEEDS on every corpus; those extra seeds feed
only the report's paired table (every TN-gram family minus Engram at the same size index, paired
by seed), and each pair's step ratio is timed again in CONFIRM_STEP_PROCESSES fresh processes (half
building Engram first) of CONFIRM_STEP_REPS alternating rounds.

Issue 40's views (`view_specs`, mini): product keys, STEM and per-layer embeddings on the map
(`TOKEN_SIZES`); five families at the raw GPT's total parameters, their MLP narrowed to pay for
the memory (`ISO_SIZES`, `iso_backbone` below). Costs per token: pareto_report.point_costs.

With the default corpus comes one large-vocabulary setting, `default@8192` (the default corpus with
a SentencePiece vocabulary of 8192; each family at its recipe size and one larger, `VOCAB_SIZES`).

The Engram / TN-gram factors are the `python -m research experiment tuning` choice on literature
(research/results/tuning-literature.json); pass `--tuned` to use others. Runs are ordered seed by
seed and corpus by corpus, so a partial sweep covers every family and size; finished runs are
reused, and the report is written from whatever runs have finished (`pareto.json`).

Paying for the memory with the backbone: the iso-parameter backbone and the map's "= total
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

Timing of the map's points. `bench_points`: one training step (forward, backward, Adam + Muon;
the trainer's micro-batches and accumulation, bf16 autocast as the mini recipes) and greedy decode
per token with the KV/memory cache, every (family, size) built in one process and timed
interleaved (rep i of every point before rep i + 1 of any), medians, at the thread count of the
caller (the command sets 1). `step_ratio`: one pair's step-time ratio in alternating rounds, with
a distribution-free interval (`median_ci`).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Any, Callable, Sequence, TypedDict

from tngram.common import TngramError, atomic_write_json, print0
from research.experiments.common import (
    SCALES,
    base_recipe,
    corpus_data,
    corpus_name,
    default_nproc,
    read_tuning_file,
    with_data,
    with_memory,
    with_seed,
    with_steps,
)
from tngram.train.recipes import (
    LONGCAT,
)  # LongCat-Flash's n-gram embedding settings (the *-oe-longcat recipes)

TUNING_CORPUS = "literature"
# Engram / TN-gram: the committed `python -m research experiment tuning --corpora literature` choice
TUNED_DEFAULT = {
    "engram": 4.0,
    "tngram": 2.0,
    # the variants were screened on literature at TN-gram's factor; the hybrid, whose
    # tables are mostly Engram-style rows, did better at Engram's (docs/LOG.md)
    "tngram-lean": 2.0,
    "tngram-sum": 2.0,
    "tngram-shared": 2.0,
    "tngram-hybrid": 4.0,
    "tngram-hsum": 4.0,
}
LR_FACTORS = (0.5, 1.0, 2.0, 4.0, 8.0)  # the grid tried for a family tuned here
MAX_LR_FACTOR = 1000.0  # a --tuned table-lr factor beyond this is a typo, not a setting
TUNE_SEEDS = 2

# family -> (recipe method, size knob, sizes in the order they are trained: first the four that
# span the range, then the largest)
SIZES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "engram": ("engram", "table_budget", (700, 1800, 3800, 8000, 11300)),
    "tngram": ("tngram", "cp_rank", (88, 176, 352, 704, 976)),
    "oe": ("oe", "table_rows", (8500, 16800, 33697, 67400, 94000)),
    "longcat": ("oe", "table_rows", (9000, 18000, 36000, 72000, 100000)),
    "dense": ("raw", "n_embd", (224, 304, 400, 560, 640)),
    # TN-gram variants beyond the paper (docs/TRAINING.md, "TN-gram variants beyond the paper")
    "tngram-lean": ("tngram", "cp_rank", (88, 176, 352, 704, 976)),
    "tngram-sum": ("tngram", "cp_rank", (100, 200, 400, 808, 1120)),
    "tngram-shared": ("tngram", "cp_rank", (196, 392, 770, 1550, 2130)),
    "tngram-hybrid": ("tngram", "hash_budget", (64, 1050, 3100, 7300, 10600)),
    # each size the largest hash_budget whose Δparams is <= Engram's at the same index
    # (tests/test_pareto.py), so every point pairs with an Engram point at no more parameters
    "tngram-hsum": ("tngram", "hash_budget", (139, 1493, 3929, 9127, 13177)),
}
FAMILIES = ("raw", *SIZES)


# the confirmation (research/RESULTS.md): the variant chosen on the literature screen against
# Engram at
# the same size index (its Δparams <= Engram's), CONFIRM_SEEDS seeds on every corpus; the seeds
# beyond the map's are tagged "confirm" and feed only the paired table (pareto_report.paired_rows)
class Confirm(TypedDict):
    family: str
    baseline: str
    size_indices: tuple[int, ...]


CONFIRM: Confirm = {"family": "tngram-hsum", "baseline": "engram", "size_indices": (2, 1)}
CONFIRM_SEEDS = 5
# the pair's step ratio (step_ratio, below): CONFIRM_STEP_PROCESSES fresh processes, half of
# them
# building Engram first, CONFIRM_STEP_REPS interleaved rounds each
CONFIRM_STEP_PROCESSES = 8
CONFIRM_STEP_REPS = 21
# memory-field settings of each variant family, applied before its size knob
VARIANTS: dict[str, dict[str, Any]] = {
    "longcat": LONGCAT,
    "tngram-lean": {"use_norm": False, "use_absorption": False},  # the ablation winners
    "tngram-sum": {"order_combine": "sum"},  # one R-wide K/V input
    "tngram-shared": {
        "order_combine": "sum",
        "share_factors": True,
    },  # one A_1..A_N for both layers
    # TN-gram R 88 + Engram-style hashed orders 2..5 (the literature screen's closest to Engram)
    "tngram-hybrid": {"cp_rank": 88, "hash_orders": (2, 3, 4, 5), "hash_embed": 128},
    # TN-gram R 64 with the orders summed + hashed orders 2..5 at 104 wide: K/V read 64 + 4 * 104 =
    # 480 features (Engram's 512), chosen on the literature screen (docs/LOG.md)
    "tngram-hsum": {
        "cp_rank": 64,
        "order_combine": "sum",
        "hash_orders": (2, 3, 4, 5),
        "hash_embed": 104,
    },
}


# ---- the iso-parameter backbone and issue 40's views ----

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


def iso_config(family: str, size: int, cfg_of: dict[str, Any]) -> Any:
    """`family` at `size` (ISO_SIZES) on the backbone shrunk to the raw GPT's total parameters."""
    method, knob, _ = ISO_SIZES[family]
    cfg = cfg_of[method]
    for fields in (VARIANTS.get(family), ISO_VARIANTS.get(family)):
        cfg = with_memory(cfg, **fields) if fields else cfg
    if knob == "table_budget":
        cfg = with_memory(cfg, table_budget=(int(size),) * (cfg.model.memory.max_ngram - 1))
    else:
        cfg = with_memory(cfg, **{knob: int(size)})
    return replace(cfg, model=iso_backbone(cfg.model, raw=cfg_of["raw"].model))


def view_specs(
    corpora: list[str],
    prefix: str,
    seeds: int,
    steps: int | None,
    factors: dict[str, float] | None = None,
    n_sizes: int = 5,
) -> list[Any]:
    """The runs issue 40's views add (mini only): the token-indexed families on the Δparams map
    (tags view "params", family pkm|stem|ple) and every ISO_SIZES point on its iso backbone
    (view "total", family "<family>-iso"); [] at other scales (no recipes for these families)."""
    from tngram.experiments.runner import RunSpec

    if prefix != "mini":
        return []
    bases = {
        c: {
            m: with_steps(with_data(base_recipe(prefix, m), *corpus_data(c)), steps)
            for m in METHODS
        }
        for c in corpora
        if c != VOCAB_CORPUS  # the vocabulary setting keeps the n-gram families only
    }
    points = [("params", f, v) for f, t in TOKEN_SIZES.items() for v in t[2][:n_sizes]]
    points += [("total", f, v) for f, t in ISO_SIZES.items() for v in t[2]]
    specs = []
    for s, corpus, (view, fam, size) in product(range(seeds), bases, points):
        if view == "params":
            knob, name = TOKEN_SIZES[fam][1], fam
            cfg = with_memory(bases[corpus][fam], **{knob: size})
        else:
            knob, name = ISO_SIZES[fam][1], f"{fam}-iso"
            cfg = with_table_lr(iso_config(fam, size, bases[corpus]), (factors or {}).get(fam, 1.0))
        cname = corpus_name(corpus)
        tags = {"corpus": cname, "family": name, "size": size, "seed_index": s, "view": view}
        cfg = with_seed(replace(cfg, name=f"pareto-{name}"), s)
        specs.append(RunSpec(f"{cname}-{name}-{knob}{size}-s{s}", cfg, tags))
    return specs


def family_config(family: str, size: int | None, cfg_of: dict[str, Any]) -> Any:
    """The config of `family` at `size` (its knob's value), from the per-method base configs."""
    if family == "raw":
        return cfg_of["raw"]
    method, knob, _ = SIZES[family]
    if size is None:
        raise ValueError(f"family {family!r} needs a size (its {knob})")
    cfg = cfg_of[method]
    if family == "dense":
        return replace(cfg, model=replace(cfg.model, n_embd=int(size)))
    if family in VARIANTS:
        cfg = with_memory(cfg, **VARIANTS[family])
    if knob == "table_budget":
        return with_memory(cfg, table_budget=(int(size),) * (cfg.model.memory.max_ngram - 1))
    return with_memory(cfg, **{knob: int(size)})


def with_table_lr(cfg: Any, factor: float) -> Any:
    from research.experiments.evidence import lr_variant

    return cfg if factor == 1.0 else lr_variant(cfg, factor)


# The large-vocabulary setting: default corpus at V 8192, each family at its recipe size and one
# larger size (Engram/TN-gram/OE knobs x2; dense: the two smallest widths, since every width also
# grows the V x d embedding 8-fold)
VOCAB_CORPUS = "default@8192"
# CORE (`--core-max`) is scored on the first seed of each point of the default corpus and its
# vocabulary setting only: its tasks are general English, out of domain for the code corpus, and
# one run costs about 35 s of CPU at 100 items per task, so every seed of every corpus would add
# hours to a CPU sweep for a score that is at chance at `mini` scale (docs/EVAL.md)
CORE_CORPORA = ("default", VOCAB_CORPUS)
CORE_SEEDS = 1
VOCAB_SIZES: dict[str, tuple[int, ...]] = {
    "engram": (40960, 81920),
    "tngram": (352, 704),
    "oe": (33697, 67394),
    "longcat": (36000, 72000),
    "dense": (224, 304),
    # the hashed variants: the largest size within Engram's
    # Δparams at V 8192, as at V 1024
    "tngram-hsum": (44159, 94547),
    "tngram-hybrid": (33751, 74713),
    # the rank variants: TN-gram's R (lean) or the largest R
    # within TN-gram's Δparams at V 8192 (sum, shared)
    "tngram-lean": (352, 704),
    "tngram-sum": (358, 717),
    "tngram-shared": (712, 1425),
}


def _base(prefix: str, data_dir: str, vocab: int, steps: int | None) -> dict[str, Any]:
    return {
        m: with_steps(with_data(base_recipe(prefix, m), data_dir, vocab), steps)
        for m in ("raw", "engram", "tngram", "oe")
    }


def tune_table_lr(out: Path, prefix: str, steps: int | None, nproc: int) -> float:
    """Over-Encoding's table-lr factor: the grid LR_FACTORS x TUNE_SEEDS seeds at the recipe size on
    the tuning corpus; the best mean val loss wins. Written to OUT/tuning/tuning.json."""
    from tngram.experiments.runner import RunSpec, run_all
    from tngram.report.runs import mean_std

    data_dir, vocab = corpus_data(TUNING_CORPUS)
    base = _base(prefix, data_dir, vocab, steps)["oe"]
    specs = [
        RunSpec(f"oe-lr{f:g}-s{s}", with_seed(with_table_lr(base, f), s), {"factor": f})
        for s in range(TUNE_SEEDS)
        for f in LR_FACTORS
    ]
    rows = run_all(specs, out / "tuning", nproc=nproc)
    stats = {f: mean_std([r["val_loss"] for r in rows if r["factor"] == f]) for f in LR_FACTORS}
    best = min(LR_FACTORS, key=lambda f: stats[f][0])
    atomic_write_json(
        out / "tuning" / "tuning.json",
        {
            "corpus": TUNING_CORPUS,
            "data": data_dir,
            "rows": rows,
            "best": {"oe": best, "longcat": best},
        },
    )
    print0(
        "Over-Encoding table lr on "
        + TUNING_CORPUS
        + ": "
        + ", ".join(f"x{f:g} {m:.4f} ± {s:.4f}" for f, (m, s) in stats.items())
        + f"; chosen x{best:g}"
    )
    return best


def read_factors(out: Path, tuned: str | None) -> dict[str, float] | None:
    """{family: table-lr factor}: TUNED_DEFAULT (or `--tuned engram-lr4,tngram-lr2,oe-lr2`) plus
    Over-Encoding's from OUT/tuning/tuning.json; None when Over-Encoding is not tuned yet."""
    factors = dict(TUNED_DEFAULT)
    if tuned:
        for item in (t.strip() for t in tuned.split(",") if t.strip()):
            fam, _, val = item.partition("-lr")
            try:
                factors[fam] = float(val)
            except ValueError:
                raise TngramError(
                    f"--tuned {tuned}: expected FAMILY-lrFACTOR items like engram-lr4, got {item!r}"
                ) from None
            if not (math.isfinite(factors[fam]) and 0 < factors[fam] <= MAX_LR_FACTOR):
                raise TngramError(
                    f"--tuned {tuned}: the table-lr factor of {item!r} must be a finite number "
                    f"in (0, {MAX_LR_FACTOR:g}]"
                )
            if fam not in SIZES:
                raise TngramError(
                    f"--tuned {tuned}: unknown family {fam!r}; valid: {', '.join(SIZES)}"
                )
    path = out / "tuning" / "tuning.json"
    if "oe" not in factors and path.is_file():
        from tngram.readback import get

        best = read_tuning_file(path)["best"]
        factors["oe"] = float(get(best, "oe", "float", f"{path}: best", lo=1e-12, hi=MAX_LR_FACTOR))
    if "oe" in factors:
        factors.setdefault("longcat", factors["oe"])
        return factors
    return None


def specs_for(
    corpora: list[str],
    prefix: str,
    seeds: int,
    steps: int | None,
    factors: dict[str, float],
    families: tuple[str, ...] = FAMILIES,
    n_sizes: int = 5,
) -> list[Any]:
    """One RunSpec per (seed, corpus, size index, family), in that order of priority: a partial
    sweep has every family at its smaller sizes first."""
    from tngram.experiments.runner import RunSpec

    bases = {c: _base(prefix, *corpus_data(c), steps) for c in corpora}
    specs = []
    for s in range(seeds):
        for corpus in corpora:
            sizes = (
                VOCAB_SIZES if corpus == VOCAB_CORPUS else {f: SIZES[f][2][:n_sizes] for f in SIZES}
            )
            points: list[tuple[str, int | None]] = [(f, None) for f in families if f == "raw"]
            points += [
                (f, sizes[f][i])
                for i in range(max(map(len, sizes.values())))
                for f in families
                if f != "raw" and f in sizes and i < len(sizes[f])
            ]
            for fam, size in points:
                cfg = family_config(fam, size, bases[corpus])
                if fam in factors:
                    cfg = with_table_lr(cfg, factors[fam])
                label = (
                    f"{corpus_name(corpus)}-{fam}"
                    + ("" if size is None else f"-{SIZES[fam][1]}{size}")
                    + f"-s{s}"
                )
                specs.append(
                    RunSpec(
                        label,
                        with_seed(replace(cfg, name=f"pareto-{fam}"), s),
                        {
                            "corpus": corpus_name(corpus),
                            "family": fam,
                            "size": size,
                            "seed_index": s,
                        },
                    )
                )
    return specs + confirm_specs(corpora, bases, seeds, factors, families)


def confirm_specs(
    corpora: list[str],
    bases: dict[str, Any],
    seeds: int,
    factors: dict[str, float],
    families: tuple[str, ...] = FAMILIES,
) -> list[Any]:
    """Seeds `seeds`..CONFIRM_SEEDS-1 of CONFIRM's pairs on every corpus but the vocabulary
    setting (tags["confirm"] = True); none when `seeds` >= CONFIRM_SEEDS or a family is left out."""
    from tngram.experiments.runner import RunSpec

    fams = [f for f in (CONFIRM["baseline"], CONFIRM["family"]) if f in families]
    specs = []
    for s in range(seeds, CONFIRM_SEEDS if len(fams) == 2 else seeds):
        for i in CONFIRM["size_indices"]:
            for corpus, fam in ((c, f) for c in corpora if c != VOCAB_CORPUS for f in fams):
                size = SIZES[fam][2][i]
                cfg = with_table_lr(family_config(fam, size, bases[corpus]), factors.get(fam, 1.0))
                specs.append(
                    RunSpec(
                        f"{corpus_name(corpus)}-{fam}-{SIZES[fam][1]}{size}-s{s}",
                        with_seed(replace(cfg, name=f"pareto-{fam}"), s),
                        {
                            "corpus": corpus_name(corpus),
                            "family": fam,
                            "size": size,
                            "seed_index": s,
                            "confirm": True,
                        },
                    )
                )
    return specs


def pareto(
    out: Path,
    scale: str = "cpu",
    seeds: int = 3,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    corpora: list[str] | None = None,
    tuned: str | None = None,
    train: bool = True,
    core_max: int | None = None,
) -> Path:
    """Tune Over-Encoding (once), train every (seed, corpus, family, size), then write the map.
    With `core_max` N, the first seed of every point of CORE_CORPORA is also scored on the offline
    CORE bundle (`tngram eval core RUN --max-per-task N`, once per run) and their maps gain a CORE
    column."""
    if data:
        raise TngramError(
            "the pareto experiment trains on the corpora of --corpora, not --data: pass the "
            f"dataset folder there (--corpora {data})"
        )
    prefix = SCALES[scale]
    nproc = nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9")
    corpora = list(corpora or ["default", TUNING_CORPUS, "code"])
    if "default" in corpora and VOCAB_CORPUS not in corpora:
        corpora.append(VOCAB_CORPUS)  # the large-vocabulary setting rides with the default corpus
    factors = read_factors(out, tuned)
    if factors is None:
        if not train:
            raise TngramError(
                f"{out}/tuning/tuning.json is missing: Over-Encoding's table lr is not tuned yet"
            )
        tune_table_lr(out, prefix, steps, nproc)
        factors = read_factors(out, tuned)
        if factors is None:
            raise TngramError(f"{out}/tuning/tuning.json: the table-lr tuning wrote no result")
    specs = specs_for(corpora, prefix, seeds, steps, factors)
    specs += view_specs(corpora, prefix, seeds, steps, factors)
    if train:
        from tngram.experiments.runner import run_all

        run_all(specs, out, nproc=nproc)
    if core_max:
        core_once(out, specs, core_max)
    from research.experiments.pareto_report import candidate_pairs, collect, write_report

    sizes, corpus_sizes = {f: v[2] for f, v in SIZES.items()}, {VOCAB_CORPUS: VOCAB_SIZES}
    bench = bench_once(out, specs)
    # a paired row that would beat Engram on the 5-rep step medians says "yes" only after its pair
    # is timed like the confirmation's (multi-process); those pairs are timed here
    rows = collect(out, specs, core_max)
    extra = candidate_pairs(rows, bench, sizes, corpus_sizes)
    if extra:
        bench = bench_once(out, specs, extra_pairs=extra)
    return write_report(
        out,
        specs,
        factors,
        bench=bench,
        core_max=core_max,
        sizes=sizes,
        corpus_sizes=corpus_sizes,
        rows=rows,
    )


def core_targets(out: Path, specs: list[Any], max_per_task: int) -> list[tuple[str, Path]]:
    """(label, run dir) of every finished run of a CORE_CORPORA corpus and a seed index below
    CORE_SEEDS with no RUN/eval/core-maxN.json."""
    from tngram.experiments.runner import run_dir_of

    dirs = [
        (s.label, run_dir_of(out, s))
        for s in specs
        if s.tags["corpus"] in CORE_CORPORA and s.tags["seed_index"] < CORE_SEEDS
    ]
    return [
        (label, d)
        for label, d in dirs
        if (d / "summary.json").is_file()
        and not (d / "eval" / f"core-max{max_per_task}.json").is_file()
    ]


def core_once(out: Path, specs: list[Any], max_per_task: int) -> None:
    """`tngram eval core RUN --max-per-task N` (a subprocess, one thread) for every `core_targets`
    run; the offline bundle must exist (`tngram eval build-bundle`)."""
    import subprocess
    import sys

    for label, rdir in core_targets(out, specs, max_per_task):
        print0(f"CORE (max {max_per_task} per task): {label}")
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "tngram",
                "eval",
                "core",
                str(rdir),
                "--max-per-task",
                str(max_per_task),
                "--threads",
                "1",
            ]
        ).returncode
        if code != 0:
            raise TngramError(f"tngram eval core {rdir} failed (exit {code})")


def bench_once(
    out: Path, specs: list[Any], reps: int = 5, extra_pairs: list[list[str]] | None = None
) -> dict[str, Any]:
    """OUT/bench.json: training-step and decode time of every (family, size) with a finished run,
    one torch thread, interleaved in this process (`bench_points`); measured once and reused while
    it covers every such point, else measured again for all of them (one process, so the times stay
    comparable). Points are keyed by family, size and vocabulary (`point_key`), not by corpus: the
    step does not depend on the text, so one timing serves every corpus of one vocabulary.
    The confirmation's pairs and `extra_pairs` ([family point key, Engram point key]) also get
    their step ratio by `step_ratio`'s multi-process protocol ("confirm_steps"): once, and again
    whenever the points are timed again (one timing session for both)."""
    import torch
    from research.experiments.pareto_report import point_key
    from tngram.experiments.runner import run_dir_of

    path = out / "bench.json"
    cfgs: dict[str, Any] = {}
    for s in specs:  # the points on the map: those with a finished run
        if (run_dir_of(out, s) / "summary.json").is_file():
            cfgs.setdefault(point_key(s.tags["family"], s.tags["size"], s.tags["corpus"]), s.config)
    pairs = [
        [point_key(f, SIZES[f][2][i]) for f in (CONFIRM["family"], CONFIRM["baseline"])]
        for i in CONFIRM["size_indices"]
    ]
    pairs += [p for p in extra_pairs or [] if p not in pairs]
    res = json.loads(path.read_text()) if path.is_file() else {}
    if "confirm_step" in res:  # one pair, as the first confirmation wrote it
        res["confirm_steps"] = [res.pop("confirm_step")]
    if not cfgs:
        return res
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not set(cfgs) <= set(res.get("points", {})):
            print0(
                f"timing {len(cfgs)} configurations (training step and decode, 1 thread, "
                f"interleaved, {reps} reps) ..."
            )
            res = bench_points(cfgs, reps=reps)
            atomic_write_json(path, res)
        # each pair is timed again when missing or measured by an older protocol (one process)
        for pair in pairs:
            done = [
                c
                for c in res.get("confirm_steps", [])
                if c["pair"] == pair
                and len(c.get("processes", [])) == CONFIRM_STEP_PROCESSES
                and c["rounds"] == CONFIRM_STEP_REPS
            ]
            if all(k in cfgs for k in pair) and not done:
                print0(
                    f"timing {pair[0]} against {pair[1]} ({CONFIRM_STEP_PROCESSES} processes x "
                    f"{CONFIRM_STEP_REPS} interleaved rounds, 1 thread) ..."
                )
                res["confirm_steps"] = [
                    c for c in res.get("confirm_steps", []) if c["pair"] != pair
                ] + [
                    {
                        "pair": pair,
                        **step_ratio(
                            cfgs[pair[0]],
                            cfgs[pair[1]],
                            CONFIRM_STEP_REPS,
                            processes=CONFIRM_STEP_PROCESSES,
                        ),
                    }
                ]
                atomic_write_json(path, res)
    finally:
        torch.set_num_threads(threads)
    return res


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ---- timing of the map's points ----


def bench_points(
    cfgs: dict[str, Any], reps: int = 5, warmup: int = 1, decode_tokens: int = 32
) -> dict[str, Any]:
    """{key: {"step_ms", "decode_ms_per_token"}} for each config, timed interleaved in this
    process."""
    import time
    from dataclasses import replace

    import torch
    from research.bench.common import interleaved, machine_info
    from research.bench.step import build_step_for
    from tngram.model.gpt import GPT

    steps = {
        k: build_step_for(c, "bf16" if c.run.dtype == "bf16" else "fp32")[0]
        for k, c in cfgs.items()
    }
    step_t = interleaved(steps, reps, warmup)
    del steps
    decoders: dict[str, Callable[[], Any]] = {}
    for k, c in cfgs.items():
        m = c.model
        if m.memory is not None and hasattr(m.memory, "zero_init_value"):
            m = replace(m, memory=replace(m.memory, zero_init_value=False))
        torch.manual_seed(0)
        model = GPT(m).eval()
        prompt = torch.randint(1, m.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

        def decode(model: Any = model, prompt: Any = prompt) -> None:
            cache: dict = {}
            with torch.no_grad():
                logits = model(prompt, cache=cache)
                for _ in range(decode_tokens):
                    logits = model(logits[:, -1:].argmax(-1), cache=cache)

        decoders[k] = decode
    dec_t = interleaved(decoders, reps, warmup)
    out = {
        k: {
            "step_ms": 1e3 * step_t[k].median,
            "decode_ms_per_token": 1e3 * dec_t[k].median / decode_tokens,
            "reps": reps,
        }
        for k in cfgs
    }
    return {
        "points": out,
        "machine": machine_info(),
        "timed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median of `xs`: the order statistics (k, n + 1 - k), k
    the largest with P(Binomial(n, 1/2) <= k - 1) <= (1 - level) / 2; (nan, nan) when n is too
    small."""
    n, xs = len(xs), sorted(xs)
    tail, k = 0.0, 0
    for j in range(n // 2 + 1):  # tail = P(B <= j), B ~ Binomial(n, 1/2)
        tail += math.comb(n, j) / 2**n
        if tail > (1 - level) / 2:
            break
        k = j + 1
    return (xs[k - 1], xs[n - k]) if k >= 1 else (math.nan, math.nan)


def _round_ratios(
    cfg_a: Any,
    cfg_b: Any,
    reps: int,
    warmup: int,
    b_first: bool = False,
    threads: int | None = None,
) -> list[float]:
    """Per-round step-time ratios a / b, alternating rounds (a then b, b then a, ...) in this
    process; b_first builds b's model and optimisers before a's."""
    import time

    import torch
    from research.bench.step import build_step_for

    if threads is not None:
        torch.set_num_threads(threads)
    order = (cfg_b, cfg_a) if b_first else (cfg_a, cfg_b)
    built = [build_step_for(c, "bf16" if c.run.dtype == "bf16" else "fp32")[0] for c in order]
    steps = built[::-1] if b_first else built  # steps[0] is a's
    ratios = []
    for i in range(warmup + reps):
        t = [0.0, 0.0]
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            steps[j]()
            t[j] = time.perf_counter() - t0
        if i >= warmup:
            ratios.append(t[0] / t[1])
    return ratios


def step_ratio(
    cfg_a: Any, cfg_b: Any, reps: int, warmup: int = 2, processes: int = 1
) -> dict[str, Any]:
    """Training step of cfg_a over cfg_b's, timed in alternating rounds (a then b, b then a, ...).

    processes=1: in this process at the caller's threads; the median of the per-round ratios and its
    95% interval (`median_ci`). processes=P > 1: P fresh processes one after another (spawned, at
    this process's thread count), the even ones building a first, the odd ones b first, `reps`
    rounds each; the ratio is the median of the per-process medians and the interval `median_ci`
    of those medians (for 6 <= P <= 8 their range; none below 6). Why: 16 fresh processes timing
    one pair (4.3 M) gave medians from 1.000 to 1.042, and some of their 95% intervals did not
    overlap ([0.997, 1.014] and [1.025, 1.045]; docs/LOG.md): the rounds of one process share
    something (its memory layout, say) that moves the ratio, so one process's interval
    understates the uncertainty."""
    from research.bench.common import loadavg

    if processes <= 1:
        ratios = _round_ratios(cfg_a, cfg_b, reps, warmup)
        lo, hi = median_ci(ratios)
        return {
            "ratio": statistics.median(ratios),
            "ci": [lo, hi],
            "rounds": reps,
            "loadavg": loadavg(),
        }
    import multiprocessing

    import torch

    ctx = multiprocessing.get_context("spawn")
    per: list[dict[str, Any]] = []
    for i in range(processes):
        with ctx.Pool(1) as pool:
            r = pool.apply(
                _round_ratios, (cfg_a, cfg_b, reps, warmup, i % 2 == 1, torch.get_num_threads())
            )
        per.append({"b_first": i % 2 == 1, "ratio": statistics.median(r), "rounds": r})
    meds = [p["ratio"] for p in per]
    lo, hi = median_ci(meds)
    return {
        "ratio": statistics.median(meds),
        "ci": [lo, hi],
        "rounds": reps,
        "processes": per,
        "loadavg": loadavg(),
    }
