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
the memory (`ISO_SIZES`, pareto_iso.iso_backbone). Costs per token: pareto_costs.

With the default corpus comes one large-vocabulary setting, `default@8192` (the default corpus with
a SentencePiece vocabulary of 8192; each family at its recipe size and one larger, `VOCAB_SIZES`).

The Engram / TN-gram factors are the `python -m research experiment tuning` choice on literature
(research/results/tuning-literature.json); pass `--tuned` to use others. Runs are ordered seed by
seed and corpus by corpus, so a partial sweep covers every family and size; finished runs are
reused, and the report is written from whatever runs have finished (`pareto.json`).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Any, TypedDict

from tngram.common import TngramError, atomic_write_json, print0
from tngram.experiments.common import (
    SCALES,
    base_recipe,
    corpus_data,
    corpus_name,
    default_nproc,
    with_data,
    with_memory,
    with_seed,
    with_steps,
)
from research.experiments.pareto_iso import (  # noqa: F401  (issue 40's views, public names)
    ISO_SIZES,
    ISO_VARIANTS,
    METHODS,
    TOKEN_SIZES,
    iso_backbone,
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
# the pair's step ratio (pareto_report.step_ratio): CONFIRM_STEP_PROCESSES fresh processes, half of
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
        from tngram.readback import get, read_tuning_file

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
    from research.experiments.pareto_report import bench_points, point_key, step_ratio
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
