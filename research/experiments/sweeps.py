"""One command per figure of the paper, plus analyses the paper lacks.

    ngram-order  N = 2..8, Engram and TN-gram: val loss and Δparams vs N            (Fig. 2)
    capacity     Engram hash heads {1,2,4,8,16} vs TN-gram CP rank at matching Δparams (Fig. 3)
    vocab        loss reduction vs raw GPT at vocabulary 8192                       (Fig. 4 left)
    ablation     TN-gram without RMSNorm / scales / absorption / both, across N    (Fig. 4 right)
    tiny-table   Engram with per-head table capacity ~1 (primes 2, 3, 5, ...): is it memorisation?
    unseen       val loss split by whether the position's N-gram occurs in the training data
    collisions   hash-collision statistics of Engram's tables on the training data (no training)
    corpora      Table 1 on every built-in corpus + seen/unseen balance + significance (evidence.py)
    data-scaling the three methods at 1, 4, 16 M training tokens, gap trend (evidence.py)
    tuning       table lr (both memories) and TN-gram factor init on a tuning corpus (evidence.py)
    dense        raw GPTs grown to the memory models' params (wider/deeper/MLP) and FLOPs
    (evidence.py)
    memory-on-trained  add TN-gram / Engram to a trained raw GPT, train only the memory
                       (research.experiments.memory_on_trained)
    adaptive-rank  fixed CP ranks vs one run that prunes its own rank (adaptive_rank.py)
    pareto       every memory family (and dense growth) over one Δparams range: the map (pareto.py)

Each writes OUT/results.csv, OUT/<name>.png and OUT/report.md.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import TngramError, atomic_write_text, print0
from research.experiments.common import (
    SCALES,
    base_recipe,
    default_nproc,
    resolve_data,
    with_data,
    with_memory,
    with_seed,
    with_steps,
)
from tngram.experiments.runner import RunSpec, run_all
from research.report.plots import bar_plot, xy_plot
from research.report.plots import fmt_pm
from tngram.report.runs import mean_std
from tngram.train.recipes import param_summary


def _specs(
    prefix: str,
    data_dir: str,
    vocab: int,
    seeds: int,
    steps: int | None,
    variants: list[tuple[str, str, dict[str, Any], dict[str, Any]]],
) -> list[RunSpec]:
    """variants: (label, method, memory field overrides, tags) -> one RunSpec per seed."""
    specs = []
    for s in range(seeds):
        for label, method, mem, tags in variants:
            cfg = with_steps(
                with_seed(with_data(base_recipe(prefix, method), data_dir, vocab), s), steps
            )
            if mem:
                cfg = with_memory(cfg, **mem)
            specs.append(
                RunSpec(f"{label}-s{s}", cfg, {"method": method, "seed": cfg.run.seed, **tags})
            )
    return specs


def _csv(rows: list[dict[str, Any]], cols: list[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _series(
    rows: list[dict[str, Any]], group: str, x: str, y: str
) -> dict[str, list[tuple[float, float, float]]]:
    out: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        out.setdefault(str(r[group]), {}).setdefault(float(r[x]), []).append(float(r[y]))
    return {g: [(xv, *mean_std(ys)) for xv, ys in pts.items()] for g, pts in out.items()}


def _table(series: dict[str, list[tuple[float, float, float]]], xname: str, seeds: int = 2) -> str:
    """Mean ± std per x and series (the mean alone with one seed)."""
    xs = sorted({x for pts in series.values() for x, _, _ in pts})
    lines = [f"| {xname} | " + " | ".join(series) + " |", "|---|" + "---|" * len(series)]
    for x in xs:
        cells = []
        for pts in series.values():
            hit = [fmt_pm(m, s, seeds) for xv, m, s in pts if xv == x]
            cells.append(hit[0] if hit else "–")
        lines.append(f"| {x:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the sweeps: each returns (variants, report builder)


def _ngram_order(scale: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    orders = range(2, 9)
    v: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [("raw", "raw", {}, {"N": 0})]
    for n in orders:
        v.append((f"engram-N{n}", "engram", {"max_ngram": n, "dilation": None}, {"N": n}))
        v.append((f"tngram-N{n}", "tngram", {"max_ngram": n, "dilation": None}, {"N": n}))
    return v


def _capacity(
    scale: str, prefix: str, vocab: int
) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    heads = (1, 2, 4, 8, 16)
    v: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [("raw", "raw", {}, {"x": 0})]
    en_base, tn_base = base_recipe(prefix, "engram"), base_recipe(prefix, "tngram")
    d = en_base.model.n_embd
    for h in heads:
        if d % h:
            continue
        v.append((f"engram-h{h}", "engram", {"n_head_per_ngram": h}, {"heads": h}))
    # TN-gram ranks spanning Engram's Δparams range: Δ is affine in R, solve for each target
    tn = replace(tn_base, model=replace(tn_base.model, vocab_size=vocab))
    en = replace(en_base, model=replace(en_base.model, vocab_size=vocab))
    d1 = param_summary(with_memory(tn, cp_rank=100))["delta_params"]
    d2 = param_summary(with_memory(tn, cp_rank=200))["delta_params"]
    per_r = (d2 - d1) / 100
    for h in heads:
        if d % h:
            continue
        target = param_summary(with_memory(en, n_head_per_ngram=h))["delta_params"]
        r = max(8, int(round(100 + (target - d1) / per_r)))
        v.append((f"tngram-R{r}", "tngram", {"cp_rank": r}, {"cp_rank": r}))
    return v


def _ablation(scale: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    orders = range(2, 9) if scale == "paper" else (3, 5, 7)
    kinds = {
        "full": {},
        "no-rmsnorm": {"use_norm": False},
        "no-scales": {"learn_scales": False},
        "no-absorption": {"use_absorption": False},
        "no-scales-no-absorption": {"learn_scales": False, "use_absorption": False},
    }
    return [
        (
            f"tngram-{k}-N{n}",
            "tngram",
            {**kw, "max_ngram": n, "dilation": None},
            {"variant": k, "N": n},
        )
        for n in orders
        for k, kw in kinds.items()
    ]


def _tiny_table(scale: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    return [
        ("raw", "raw", {}, {"variant": "raw"}),
        ("engram", "engram", {}, {"variant": "engram (5V per head)"}),
        (
            "engram-tiny",
            "engram",
            {"table_budget": (1, 1, 1, 1)},
            {"variant": "engram (capacity ~1 per head)"},
        ),
        ("tngram", "tngram", {}, {"variant": "tngram"}),
    ]


def _vocab(scale: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    return [(m, m, {}, {}) for m in ("raw", "engram", "tngram")]


DEFAULT_SEEDS = {
    "corpora": 5,
    "data-scaling": 3,
    "adaptive-rank": 3,
    "tuning": 2,
    "pareto": 3,
    "table-update": 3,
}


def run_experiment(
    name: str,
    out: Path,
    scale: str = "cpu",
    seeds: int | None = None,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    ranks: tuple[int, ...] | None = None,
    corpora: list[str] | None = None,
    budgets: tuple[int, ...] | None = None,
    tuned: Path | str | None = None,
    report_only: bool = False,
    core_max: int | None = None,
) -> Path:
    """Run experiment `name`; seeds=None means its default (DEFAULT_SEEDS, else 1)."""
    if name not in EXPERIMENTS:
        raise TngramError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    if budgets is not None and name != "data-scaling":
        raise TngramError(f"--budgets applies to the data-scaling experiment only, not {name!r}")
    if tuned is not None and name not in ("corpora", "data-scaling", "pareto"):
        raise TngramError(
            f"--tuned applies to the corpora, data-scaling and pareto experiments only, not "
            f"{name!r}"
        )
    seeds = seeds or DEFAULT_SEEDS.get(name, 1)
    if corpora is not None and name not in (
        "corpora",
        "data-scaling",
        "dense",
        "tuning",
        "pareto",
        "table-update",
    ):
        raise TngramError(
            f"--corpora applies to the corpora, data-scaling, dense, tuning, pareto and "
            f"table-update "
            f"experiments only, not {name!r}"
        )
    if name == "pareto":
        from research.experiments.pareto import pareto

        return pareto(
            out,
            scale,
            seeds,
            data,
            steps,
            nproc,
            corpora=corpora,
            tuned=None if tuned is None else str(tuned),
            train=not report_only,
            core_max=core_max,
        )
    if name == "table-update":
        if core_max or data:
            raise TngramError(
                "table-update trains on built-in corpora (--corpora); --data and --core-max do not "
                "apply"
            )
        from research.experiments.table_update import table_update

        return table_update(out, scale, seeds, steps, nproc, corpora=corpora, train=not report_only)
    if report_only or core_max:
        raise TngramError(
            f"--report-only applies to the pareto and table-update experiments and --core-max "
            f"to pareto only, not {name!r}"
        )
    if name in ("corpora", "data-scaling", "dense", "tuning"):
        from research.experiments import evidence

        if name == "data-scaling":
            return evidence.data_scaling(
                out,
                scale,
                seeds,
                data,
                steps,
                nproc,
                corpora=corpora,
                multipliers=budgets or (1, 4, 16),
                tuned=tuned,
            )
        if name == "corpora":
            return evidence.corpora(
                out, scale, seeds, data, steps, nproc, corpora=corpora, tuned=tuned
            )
        fn = getattr(evidence, name)
        return fn(out, scale, seeds, data, steps, nproc, corpora=corpora)
    if name == "adaptive-rank":
        from research.experiments.adaptive_rank import run_adaptive_rank

        return run_adaptive_rank(out, scale, seeds, data, steps, nproc, ranks)
    if ranks is not None:
        raise TngramError(f"--ranks applies to the adaptive-rank experiment only, not {name!r}")
    return EXPERIMENTS[name](out, scale, seeds, data, steps, nproc)


def _train_sweep(
    out: Path,
    scale: str,
    seeds: int,
    data: str | None,
    steps: int | None,
    nproc: int | None,
    variants_fn: Callable[..., list],
    vocab_size: int = 1024,
):
    prefix = SCALES[scale]
    data_dir, vocab = resolve_data(data, vocab_size=vocab_size)
    variants = variants_fn(scale, prefix, vocab) if variants_fn is _capacity else variants_fn(scale)
    specs = _specs(prefix, data_dir, vocab, seeds, steps, variants)
    rows = run_all(
        specs, out, nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9")
    )
    return rows, data_dir


def _exp_ngram_order(out, scale, seeds, data, steps, nproc):
    rows, data_dir = _train_sweep(out, scale, seeds, data, steps, nproc, _ngram_order)
    mem = [r for r in rows if r["method"] != "raw"]
    raw = mean_std([r["val_loss"] for r in rows if r["method"] == "raw"])
    loss = _series(mem, "method", "N", "val_loss")
    params = {
        k: [(x, m / 1e6, s / 1e6) for x, m, s in v]
        for k, v in _series(mem, "method", "N", "delta_params").items()
    }
    xy_plot(
        loss,
        out / "ngram-order.png",
        "max n-gram order N",
        "val loss (nats/token)",
        f"val loss vs N (raw GPT {raw[0]:.4f})",
        panels=[
            {
                "series": params,
                "xlabel": "max n-gram order N",
                "ylabel": "Δparams (M)",
                "title": "Δparams vs N",
            }
        ],
    )
    return _write(
        out,
        "ngram-order",
        rows,
        ["method", "N", "seed", "delta_params", "train_loss", "val_loss", "val_bpb"],
        f"Validation loss vs maximum order N (raw GPT: {fmt_pm(*raw, seeds)}).\n\n"
        + _table(loss, "N", seeds)
        + "\n\nΔparams (M):\n\n"
        + _table(params, "N", seeds),
        data_dir,
    )


def _exp_capacity(out, scale, seeds, data, steps, nproc):
    rows, data_dir = _train_sweep(out, scale, seeds, data, steps, nproc, _capacity)
    mem = [r for r in rows if r["method"] != "raw"]
    for r in mem:
        r["delta_m"] = r["delta_params"] / 1e6
    loss = _series(mem, "method", "delta_m", "val_loss")
    xy_plot(
        loss,
        out / "capacity.png",
        "Δparams (M)",
        "val loss (nats/token)",
        "Engram heads {1,2,4,8,16} vs TN-gram CP rank",
    )
    return _write(
        out,
        "capacity",
        rows,
        ["method", "heads", "cp_rank", "seed", "delta_params", "val_loss", "val_bpb"],
        "Validation loss vs Δparams: Engram scaled by hash heads, TN-gram by CP rank.\n\n"
        + _table(loss, "Δparams (M)", seeds),
        data_dir,
    )


def _exp_vocab(out, scale, seeds, data, steps, nproc):
    rows, data_dir = _train_sweep(out, scale, seeds, data, steps, nproc, _vocab, vocab_size=8192)
    raw_tr = mean_std([r["train_loss"] for r in rows if r["method"] == "raw"])[0]
    raw_va = mean_std([r["val_loss"] for r in rows if r["method"] == "raw"])[0]
    lines = [
        "| method | Δparams | train-loss reduction % | val-loss reduction % |",
        "|---|---|---|---|",
    ]
    groups: dict[str, dict[str, tuple[float, float]]] = {"train loss": {}, "val loss": {}}
    for m in ("engram", "tngram"):
        rs = [r for r in rows if r["method"] == m]
        tr = mean_std([100 * (raw_tr - r["train_loss"]) / raw_tr for r in rs])
        va = mean_std([100 * (raw_va - r["val_loss"]) / raw_va for r in rs])
        lines.append(
            f"| {m} | {rs[0]['delta_params'] / 1e6:.2f}M | {fmt_pm(*tr, len(rs), '.2f')} | "
            f"{fmt_pm(*va, len(rs), '.2f')} |"
        )
        groups["train loss"][m], groups["val loss"][m] = tr, va
    bar_plot(groups, out / "vocab.png", "loss reduction vs raw GPT (%)", "vocabulary 8192")
    return _write(
        out,
        "vocab",
        rows,
        ["method", "seed", "delta_params", "train_loss", "val_loss", "val_bpb"],
        "Loss reduction relative to the raw GPT at vocabulary 8192 (paper: Engram 3.99/4.17 %, "
        "TN-gram 4.27/4.44 % train/val).\n\n" + "\n".join(lines),
        data_dir,
    )


def _exp_ablation(out, scale, seeds, data, steps, nproc):
    rows, data_dir = _train_sweep(out, scale, seeds, data, steps, nproc, _ablation)
    loss = _series(rows, "variant", "N", "val_loss")
    xy_plot(
        loss,
        out / "ablation.png",
        "max n-gram order N",
        "val loss (nats/token)",
        "TN-gram ablations",
    )
    return _write(
        out,
        "ablation",
        rows,
        ["variant", "N", "seed", "delta_params", "val_loss", "val_bpb"],
        "TN-gram component ablations (validation loss).\n\n" + _table(loss, "N", seeds),
        data_dir,
    )


def _exp_tiny_table(out, scale, seeds, data, steps, nproc):
    rows, data_dir = _train_sweep(out, scale, seeds, data, steps, nproc, _tiny_table)
    lines = ["| variant | Δparams | val loss | val BPB |", "|---|---|---|---|"]
    series = {}
    for i, v in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        rs = [r for r in rows if r["variant"] == v]
        m, s = mean_std([r["val_loss"] for r in rs])
        series[v] = [(float(i), m, s)]
        lines.append(
            f"| {v} | {rs[0]['delta_params'] / 1e6:.2f}M | {fmt_pm(m, s, len(rs))} | "
            f"{mean_std([r['val_bpb'] for r in rs])[0]:.4f} |"
        )
    xy_plot(
        series,
        out / "tiny-table.png",
        "variant",
        "val loss (nats/token)",
        "does the gain need table capacity?",
    )
    return _write(
        out,
        "tiny-table",
        rows,
        ["variant", "seed", "delta_params", "val_loss", "val_bpb"],
        "Engram with a per-head table of capacity ~1 (primes 2, 3, 5, ...) against full Engram.\n\n"
        + "\n".join(lines),
        data_dir,
    )


def _exp_unseen(out, scale, seeds, data, steps, nproc):
    from research.experiments.analysis import unseen_split

    rows, data_dir = _train_sweep(out, scale, seeds, data, steps, nproc, _vocab)
    return unseen_split(out, rows, data_dir)


def _exp_collisions(out, scale, seeds, data, steps, nproc):
    from research.experiments.analysis import collision_stats

    prefix = SCALES[scale]
    data_dir, vocab = resolve_data(data)
    cfg = with_data(base_recipe(prefix, "engram"), data_dir, vocab)
    return collision_stats(out, cfg, data_dir)


def _write(
    out: Path, name: str, rows: list[dict[str, Any]], cols: list[str], body: str, data_dir: str
) -> Path:
    atomic_write_text(out / "results.csv", _csv(rows, cols))
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment {name}\n\nData: "
        f"`{data_dir}`\n\n{body}\n\n![{name}]({name}.png)\n",
    )
    print0(body)
    print0(f"\nreport: {out / 'report.md'}")
    return out / "report.md"


def _exp_memory_on_trained(out, scale, seeds, data, steps, nproc):
    from research.experiments.memory_on_trained import run  # its own module (export helper's area)

    return run(out, scale, seeds, data, steps, nproc)


EXPERIMENTS: dict[str, Callable[..., Path]] = {
    "ngram-order": _exp_ngram_order,
    "capacity": _exp_capacity,
    "vocab": _exp_vocab,
    "ablation": _exp_ablation,
    "tiny-table": _exp_tiny_table,
    "unseen": _exp_unseen,
    "collisions": _exp_collisions,
    "memory-on-trained": _exp_memory_on_trained,
    "adaptive-rank": lambda *a: run_experiment("adaptive-rank", *a),
    "corpora": lambda *a: run_experiment("corpora", *a),
    "data-scaling": lambda *a: run_experiment("data-scaling", *a),
    "dense": lambda *a: run_experiment("dense", *a),
    "tuning": lambda *a: run_experiment("tuning", *a),
    "pareto": lambda *a: run_experiment("pareto", *a),
    "table-update": lambda *a: run_experiment("table-update", *a),
}
