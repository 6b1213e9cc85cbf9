"""Evidence experiments: does TN-gram vs Engram hold across corpora and training budgets?

    corpora       Table 1 (raw / Engram / TN-gram) on every built-in corpus (`--corpora`), the
                  seen/unseen n-gram balance of each, the TN-gram − Engram gap against the
                  unseen fraction, and paired significance per corpus and pooled.
    data-scaling  the same three methods at 1, 4 and 16 M training tokens (steps × 1, 4, 16) on
                  one corpus: the gap with its 95% CI per budget and a least-squares trend in
                  log10(tokens) with its uncertainty, extrapolated (with a warning) to 3 B tokens.
    dense         raw GPTs grown to the Engram / TN-gram models' total parameters (wider, deeper,
                  larger MLP) and to their training FLOPs per token; val loss vs params and FLOPs.

Both reuse finished runs (one `tngram compare`-style folder per corpus or budget under OUT).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from tngram.common import atomic_write_json, atomic_write_text, print0
from research.experiments.common import (
    EVIDENCE_CORPORA,
    SCALES,
    base_recipe,
    corpus_data,
    corpus_name,
    default_nproc,
    read_tuning_file,
    with_data,
    with_steps,
)

METHODS = ("raw", "engram", "tngram")
PAPER_TOKENS = 3.0e9  # the paper's training budget (6000 steps x 524k tokens)


def _configs(prefix: str, data_dir: str, vocab: int, steps: int | None) -> dict[str, Any]:
    return {
        m: with_steps(with_data(base_recipe(prefix, m), data_dir, vocab), steps) for m in METHODS
    }


def corpus_seen_fractions(cfg: Any) -> dict[str, dict[int, float]]:
    """Seen fractions of val positions per order, against the tokens the run reads ("consumed")
    and against the whole train split ("train")."""
    from tngram.data.build import open_dataset
    from tngram.data.loader import load_val_tokens
    from research.experiments.analysis import (
        consumed_train_tokens,
        seen_fractions,
        train_split_tokens,
    )

    info = open_dataset(cfg.data.dir)
    seq = cfg.model.sequence_len
    val = load_val_tokens(info.val_files, seq)
    if cfg.data.val_tokens:
        val = val[: (cfg.data.val_tokens // seq) * seq + 1]
    pos = np.asarray(val[:-1].numpy())
    return {
        "consumed": seen_fractions(pos, consumed_train_tokens(cfg)),
        "train": seen_fractions(pos, train_split_tokens(cfg.data.dir)),
    }


def gap_points(rows: list[dict[str, Any]]) -> list[float]:
    from tngram.report.compare import paired_metric

    return paired_metric(rows, "tngram", "engram", "val_loss")


def corpora(
    out: Path,
    scale: str = "cpu",
    seeds: int = 5,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    corpora: list[str] | None = None,
    tuned: Path | str | None = None,
) -> Path:
    """`python -m research experiment corpora`: Table 1 on each corpus + seen/unseen balance +
    significance;
    with `tuned` (a tuning folder or setting names, see `read_best`), each memory at that
    setting."""
    from tngram.experiments.compare import compare_configs
    from tngram.report.compare import significance_table
    from research.report.plots import xy_plot

    names = list(corpora or EVIDENCE_CORPORA)  # built-in names or dataset folders
    prefix = SCALES[scale]
    best = read_best(tuned) if tuned is not None else None  # before any data or training work
    by_corpus: dict[str, list[dict[str, Any]]] = {}
    seen: dict[str, Any] = {}
    for corpus in names:
        name = corpus_name(corpus)
        data_dir, vocab = corpus_data(corpus)
        cfgs = _configs(prefix, data_dir, vocab, steps)
        if best is not None:
            cfgs = tuned_configs(cfgs, best)
        res = compare_configs(
            cfgs,
            out / name,
            seeds=seeds,
            preset=scale,
            data_dir=data_dir,
            nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9"),
        )
        by_corpus[name] = res["rows"]
        seen[name] = corpus_seen_fractions(cfgs["tngram"])
    lines = [
        "| corpus | seen 2-gram | 3-gram | 4-gram | 5-gram | TN-gram − Engram val loss per seed |",
        "|---|---|---|---|---|---|",
    ]
    series = {}
    for name in map(corpus_name, names):
        f = seen[name]["consumed"]
        gaps = gap_points(by_corpus[name])
        lines.append(
            f"| {name} | "
            + " | ".join(f"{f[n]:.1%}" for n in (2, 3, 4, 5))
            + " | "
            + ", ".join(f"{g:+.4f}" for g in gaps)
            + " |"
        )
        series[name] = [(1 - f[5], g, 0.0) for g in gaps]
    xy_plot(
        series,
        out / "gap-vs-unseen.png",
        "fraction of val positions with an unseen 5-gram",
        "TN-gram − Engram val loss (nats/token)",
        "gap vs unseen 5-grams (one point per corpus and seed)",
    )
    body = (
        "Seen fractions: share of scored val positions whose n-gram occurs in the training tokens "
        "the runs read.\n\n" + "\n".join(lines) + "\n\n" + significance_table(by_corpus)
    )
    atomic_write_json(out / "corpora.json", {"seen": seen, "rows": by_corpus})
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment corpora\n\n{body}\n\n![gap](gap-vs-unseen.png)\n",
    )
    print0(body)
    return out / "report.md"


def log_trend(tokens: list[float], gaps: list[float], at: float = PAPER_TOKENS) -> dict[str, float]:
    """Least squares gap = a + b·log10(tokens) over all (budget, seed) points: slope b with its
    95% CI, and the fit at `at` with a 95% prediction interval (t with n − 2 df). nan if n < 3."""
    from tngram.common import require_extra

    student_t = require_extra("scipy.stats", "report", "confidence intervals").t

    x, y = np.log10(np.asarray(tokens, float)), np.asarray(gaps, float)
    n = x.size
    if n < 3 or np.ptp(x) == 0:
        return {
            "n": n,
            "slope": math.nan,
            "slope_lo": math.nan,
            "slope_hi": math.nan,
            "pred": math.nan,
            "pred_lo": math.nan,
            "pred_hi": math.nan,
        }
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    s2 = float(resid @ resid) / (n - 2)
    sxx = float(((x - x.mean()) ** 2).sum())
    q = float(student_t.ppf(0.975, n - 2))
    se_b = math.sqrt(s2 / sxx)
    x0 = math.log10(at)
    pred = a + b * x0
    se_pred = math.sqrt(s2 * (1 + 1 / n + (x0 - x.mean()) ** 2 / sxx))
    return {
        "n": n,
        "slope": float(b),
        "slope_lo": b - q * se_b,
        "slope_hi": b + q * se_b,
        "pred": float(pred),
        "pred_lo": pred - q * se_pred,
        "pred_hi": pred + q * se_pred,
    }


DATA_SCALING_CORPUS = "code-large"  # the one built-in corpus past the 16x budget's 16.8 M tokens


def check_budgets_fit(data_dir: str, multipliers: tuple[int, ...], base_tokens: int) -> None:
    """Refuse (before any training) a budget that reads more tokens than the train split holds:
    the loader would wrap around and show tokens twice, so the point would not measure more data."""
    from tngram.common import TngramError
    from tngram.data.build import open_dataset

    have = int(open_dataset(data_dir).manifest["tokens"]["train"])
    over = [k for k in multipliers if k * base_tokens > have]
    if over:
        raise TngramError(
            f"--budgets: {max(over)}x reads {max(over) * base_tokens / 1e6:.1f} M tokens but "
            f"{data_dir} holds {have / 1e6:.1f} M train tokens (the stream would repeat); "
            f"use smaller budgets or a larger corpus (--corpora {DATA_SCALING_CORPUS})"
        )


def data_scaling(
    out: Path,
    scale: str = "cpu",
    seeds: int = 3,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    corpora: list[str] | None = None,
    multipliers: tuple[int, ...] = (1, 4, 16),
    tuned: Path | str | None = None,
) -> Path:
    """`python -m research experiment data-scaling`: the recipes at steps × {1, 4, 16} on one corpus
    (`--corpora NAME`, default `code-large`, the largest built-in corpus; or `--data DIR`); with
    `tuned`, each memory at that tuned setting (see `read_best`)."""
    from research.experiments.common import resolve_data
    from tngram.experiments.compare import compare_configs
    from tngram.report.compare import significance_table
    from research.report.plots import xy_plot

    prefix = SCALES[scale]
    best = read_best(tuned) if tuned is not None else None  # before any data or training work
    data_dir, vocab = (
        resolve_data(data) if data else corpus_data((corpora or [DATA_SCALING_CORPUS])[0])
    )
    raw = base_recipe(prefix, "raw")
    base_steps = steps or raw.schedule.steps
    check_budgets_fit(data_dir, multipliers, base_steps * raw.data.global_batch_tokens)
    by_budget: dict[str, list[dict[str, Any]]] = {}
    pts_tok, pts_gap = [], []
    for k in multipliers:
        cfgs = _configs(prefix, data_dir, vocab, base_steps * k)
        if best is not None:
            cfgs = tuned_configs(cfgs, best)
        tokens = base_steps * k * cfgs["raw"].data.global_batch_tokens
        label = f"{tokens / 1e6:g}M"
        res = compare_configs(
            cfgs,
            out / label,
            seeds=seeds,
            preset=scale,
            data_dir=data_dir,
            nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9"),
        )
        by_budget[label] = res["rows"]
        for g in gap_points(res["rows"]):
            pts_tok.append(tokens)
            pts_gap.append(g)
    trend = log_trend(pts_tok, pts_gap)
    xy_plot(
        {"TN-gram − Engram": [(t, g, 0.0) for t, g in zip(pts_tok, pts_gap)]},
        out / "data-scaling.png",
        "training tokens",
        "TN-gram − Engram val loss (nats/token)",
        "gap vs training tokens",
    )
    body = (
        significance_table(by_budget) + "\n\n"
        f"Trend gap = a + b·log10(tokens) over {trend['n']} (budget, seed) points: slope b = "
        f"{trend['slope']:+.4f} per decade (95% CI [{trend['slope_lo']:+.4f}, "
        f"{trend['slope_hi']:+.4f}]); "
        f"extrapolated to {PAPER_TOKENS:.0e} tokens: {trend['pred']:+.4f} "
        f"(95% prediction interval [{trend['pred_lo']:+.4f}, {trend['pred_hi']:+.4f}]). The "
        f"extrapolation "
        "spans two to three decades beyond the data with a tiny model: read it as a direction, not "
        "a number."
    )
    atomic_write_json(
        out / "data-scaling.json", {"data": data_dir, "trend": trend, "rows": by_budget}
    )
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment data-scaling\n\nData: `{data_dir}`\n\n{body}\n\n"
        "![scaling](data-scaling.png)\n",
    )
    print0(body)
    return out / "report.md"


# ---- dense baselines: is memory a better use of parameters / FLOPs than a bigger raw GPT?


def train_flops_per_token(cfg: Any) -> float:
    """Training FLOPs per token, 6 x matmul weights (nn.Linear + tied head) + 12 L d T for
    attention (the estimate of `tngram plan`); memory lookups add no matmul and are not counted."""
    import torch
    from tngram.model.flops import matmul_params
    from tngram.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg.model)
    m = cfg.model
    return float(6 * matmul_params(model) + 12 * m.n_layer * m.n_embd * m.sequence_len)


def _closest(cfg: Any, field: str, values: range, measure: Any, target: float) -> Any:
    """The config with model.`field` in `values` whose measure(cfg) is closest to target."""
    from dataclasses import replace

    best, best_err = cfg, math.inf
    for v in values:
        c = replace(cfg, model=replace(cfg.model, **{field: v}))
        try:
            c.model.validate()
        except Exception:  # noqa: BLE001 - shape not allowed (head dims), skip it
            continue
        err = abs(measure(c) - target)
        if err < best_err:
            best, best_err = c, err
        elif measure(c) > target:
            break
    return best


def dense_variants(raw: Any, memory_cfgs: dict[str, Any]) -> dict[str, Any]:
    """Raw GPTs grown to each memory model's total parameters — wider (n_embd), deeper (n_layer),
    larger MLP (mlp_mult) — and to its training FLOPs per token (wider). Names:
    dense-<way>-<method>."""
    from tngram.train.recipes import param_summary

    total = lambda c: param_summary(c)["total_params"]  # noqa: E731
    m = raw.model
    step = 2 * m.n_head
    out = {}
    for method, mc in memory_cfgs.items():
        p, f = total(mc), train_flops_per_token(mc)
        out[f"dense-wide-{method}"] = _closest(
            raw, "n_embd", range(m.n_embd, 16 * m.n_embd + 1, step), total, p
        )
        out[f"dense-deep-{method}"] = _closest(
            raw, "n_layer", range(m.n_layer, 64 * m.n_layer + 1), total, p
        )
        out[f"dense-mlp-{method}"] = _closest(
            raw, "mlp_mult", range(m.mlp_mult, 256 * m.mlp_mult + 1), total, p
        )
        out[f"dense-flops-{method}"] = _closest(
            raw, "n_embd", range(m.n_embd, 16 * m.n_embd + 1, step), train_flops_per_token, f
        )
    return out


def dense(
    out: Path,
    scale: str = "cpu",
    seeds: int = 1,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    corpora: list[str] | None = None,
) -> Path:
    """`python -m research experiment dense`: raw / Engram / TN-gram and the dense_variants on one
    corpus;
    val loss against total parameters and training FLOPs (Pareto figure)."""
    from dataclasses import replace
    from research.experiments.common import resolve_data, with_seed
    from tngram.experiments.runner import RunSpec, run_all
    from tngram.train.recipes import param_summary
    from research.report.plots import xy_plot
    from tngram.report.runs import mean_std

    prefix = SCALES[scale]
    data_dir, vocab = resolve_data(data) if data else corpus_data((corpora or ["default"])[0])
    cfgs = _configs(prefix, data_dir, vocab, steps)
    variants = {
        **cfgs,
        **{
            k: replace(c, name=k)
            for k, c in dense_variants(
                cfgs["raw"], {m: cfgs[m] for m in ("engram", "tngram")}
            ).items()
        },
    }
    specs = [
        RunSpec(f"{k}-s{s}", with_seed(c, s), {"method": k})
        for s in range(seeds)
        for k, c in variants.items()
    ]
    rows = run_all(
        specs, out, nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9")
    )
    lines = [
        "| model | n_embd | n_layer | mlp_mult | total params | train FLOPs/token | val loss |",
        "|---|---|---|---|---|---|---|",
    ]
    by_params: dict[str, list[tuple[float, float, float]]] = {}
    by_flops: dict[str, list[tuple[float, float, float]]] = {}
    for k, c in variants.items():
        loss = mean_std([r["val_loss"] for r in rows if r["method"] == k])
        p, f = param_summary(c)["total_params"], train_flops_per_token(c)
        from research.report.plots import fmt_pm

        lines.append(
            f"| {k} | {c.model.n_embd} | {c.model.n_layer} | {c.model.mlp_mult} | {p / 1e6:.2f}M | "
            f"{f / 1e6:.1f}M | {fmt_pm(*loss, seeds)} |"
        )
        group = k.split("-")[0] if not k.startswith("dense") else "-".join(k.split("-")[:2])
        by_params.setdefault(group, []).append((p / 1e6, *loss))
        by_flops.setdefault(group, []).append((f / 1e6, *loss))
    xy_plot(
        by_params,
        out / "dense.png",
        "total parameters (M)",
        "val loss (nats/token)",
        "val loss vs parameters",
        panels=[
            {
                "series": by_flops,
                "xlabel": "training FLOPs per token (M)",
                "ylabel": "val loss (nats/token)",
                "title": "val loss vs training FLOPs",
            }
        ],
    )
    body = (
        "Raw GPTs grown to the memory models' total parameters (three ways) and training FLOPs.\n\n"
        + "\n".join(lines)
    )
    atomic_write_json(out / "dense.json", {"data": data_dir, "rows": rows})
    atomic_write_text(
        out / "report.md",
        "# python -m research experiment dense\n\nData: "
        f"`{data_dir}`\n\n{body}\n\n![dense](dense.png)\n",
    )
    print0(body)
    return out / "report.md"


# ---- fair tuning: each memory's table learning rate (and TN-gram's factor init) on one corpus

# The starting grid (2 seeds = 22 runs, ~1 h on 2 cores); `tuning` extends a method's lr grid by
# x2 steps while its best lands on an edge (widen_lr_grid).
TABLE_LR_FACTORS = (0.5, 1.0, 2.0, 4.0)  # x the recipe's table lr (tied_embed_lr when unset)
FACTOR_INIT_STDS = (0.03, 0.1, 0.3)  # TN-gram factor_init_std (recipe: 0.1)


def lr_variant(cfg: Any, factor: float) -> Any:
    """cfg with the memory table lr at `factor` x the recipe's (tied_embed_lr when unset)."""
    from dataclasses import replace

    return replace(cfg, optim=replace(cfg.optim, memory_table_lr=table_lr(cfg) * factor))


def table_lr(cfg: Any) -> float:
    """The memory tables' learning rate a run trains with (the optimiser's own rule)."""
    from tngram.optim.groups import group_lrs

    return group_lrs(cfg.optim)["memory_table"]


def tuning_variants(cfgs: dict[str, Any]) -> dict[str, Any]:
    """Engram and TN-gram at each table-lr factor; TN-gram also at each factor_init_std other than
    the recipe's (at the recipe's table lr: the recipe's own std is tngram-lr1, not trained twice).
    Names: <method>-lr<factor>, tngram-init<std>."""
    from research.experiments.common import with_memory

    out = {
        f"{m}-lr{f:g}": lr_variant(cfgs[m], f)
        for m in ("engram", "tngram")
        for f in TABLE_LR_FACTORS
    }
    for s in FACTOR_INIT_STDS:
        if s != cfgs["tngram"].model.memory.factor_init_std:
            out[f"tngram-init{s:g}"] = with_memory(cfgs["tngram"], factor_init_std=s)
    return out


SETTING_RE = re.compile(r"^(engram-lr|tngram-lr|tngram-init)(\d+(\.\d+)?|\.\d+)$")


def read_best(tuned: Path | str) -> dict[str, str]:
    """{method: setting name} from a finished `python -m research experiment tuning` folder, or
    from the
    setting names it printed ("Best on this corpus"), e.g. "engram-lr4,tngram-lr2": the choice
    can be reused without keeping the tuning runs."""
    from tngram.common import MissingFileError, TngramError

    path = Path(tuned)
    if path.is_dir() or not all(SETTING_RE.match(k.strip()) for k in str(tuned).split(",")):
        if not (path / "tuning.json").is_file():
            raise MissingFileError(
                f"--tuned {tuned}: no tuning.json there and not a list of setting names "
                "like engram-lr4,tngram-lr2; run `python -m research experiment tuning --out "
                f"{tuned}` first"
            )
        return read_tuning_file(path / "tuning.json")["best"]
    best: dict[str, str] = {}
    for key in (k.strip() for k in str(tuned).split(",")):
        m = key.split("-", 1)[0]
        if m in best:
            raise TngramError(
                f"--tuned {tuned}: two settings for {m} ({best[m]}, {key}); give one per memory"
            )
        best[m] = key
    return best


def tuned_configs(cfgs: dict[str, Any], best: dict[str, str]) -> dict[str, Any]:
    """cfgs with each method in `best` at its setting: "<m>-lr<f>" (table lr x f) or
    "tngram-init<std>" (factor_init_std)."""
    from research.experiments.common import with_memory

    out = dict(cfgs)
    for m, key in best.items():
        v = key.split("-", 1)[1]
        out[m] = (
            lr_variant(cfgs[m], float(v[2:]))
            if v.startswith("lr")
            else with_memory(cfgs[m], factor_init_std=float(v[len("init") :]))
        )
    return out


MAX_LR_STEPS = 2  # how many x2 (or /2) steps the grid may grow beyond TABLE_LR_FACTORS per method


def widen_lr_grid(
    variants: dict[str, Any], loss: dict[str, float], cfgs: dict[str, Any]
) -> dict[str, Any]:
    """For each method whose best table-lr factor is the largest (smallest) tried, the variant one
    x2 (/2) step beyond, unless the grid already grew MAX_LR_STEPS steps that way. {} when no best
    sits on an edge: the grid then brackets every method's best."""
    new = {}
    for m in ("engram", "tngram"):
        tried = {float(k.split("-lr")[1]): k for k in variants if k.startswith(f"{m}-lr")}
        best = min(tried, key=lambda f: loss[tried[f]])
        for edge, step, limit in (
            (max(tried), 2.0, max(TABLE_LR_FACTORS) * 2**MAX_LR_STEPS),
            (min(tried), 0.5, min(TABLE_LR_FACTORS) / 2**MAX_LR_STEPS),
        ):
            f = best * step
            if best == edge and (f <= limit if step > 1 else f >= limit):
                new[f"{m}-lr{f:g}"] = lr_variant(cfgs[m], f)
    return new


def tuning_table(variants: dict[str, Any], stats: dict[str, tuple[float, float]]) -> str:
    """Markdown rows: setting, the table lr it trains with, factor_init_std, val loss mean ± std."""
    lines = [
        "| setting | table lr | factor_init_std | val loss (mean ± std) |",
        "|---|---|---|---|",
    ]
    for k, c in variants.items():
        std = getattr(c.model.memory, "factor_init_std", None)
        lines.append(
            f"| {k} | {table_lr(c):g} | {'–' if std is None else f'{std:g}'} | "
            f"{stats[k][0]:.4f} ± {stats[k][1]:.4f} |"
        )
    return "\n".join(lines)


def tuning(
    out: Path,
    scale: str = "cpu",
    seeds: int = 2,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    corpora: list[str] | None = None,
) -> Path:
    """`python -m research experiment tuning`: the tuning sweep on one corpus (default
    `literature`, so that
    settings are never chosen on the default corpus); prints each method's best setting."""
    from research.experiments.common import resolve_data, with_seed
    from tngram.experiments.runner import RunSpec, run_all
    from tngram.report.runs import mean_std

    prefix = SCALES[scale]
    data_dir, vocab = resolve_data(data) if data else corpus_data((corpora or ["literature"])[0])
    cfgs = _configs(prefix, data_dir, vocab, steps)
    variants, todo = {}, tuning_variants(cfgs)
    while todo:  # the grid, then one x2 step beyond any method whose best is on an edge
        variants.update(todo)
        specs = [
            RunSpec(f"{k}-s{s}", with_seed(c, s), {"method": k})
            for s in range(seeds)
            for k, c in variants.items()
        ]
        rows = run_all(
            specs, out, nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9")
        )
        stats = {k: mean_std([r["val_loss"] for r in rows if r["method"] == k]) for k in variants}
        todo = widen_lr_grid(variants, {k: v[0] for k, v in stats.items()}, cfgs)
    best = {
        m: min((k for k in variants if k.startswith(m)), key=lambda k: stats[k][0])
        for m in ("engram", "tngram")
    }
    atomic_write_json(
        out / "tuning.json", {"data": data_dir, "rows": rows, "best": best}
    )  # first: the choice
    body = (
        tuning_table(variants, stats)
        + "\n\nBest on this corpus (use these on the others, never re-tuned "
        "there): " + ", ".join(f"{m}: {k}" for m, k in best.items())
    )
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment tuning\n\nData: `{data_dir}`\n\n{body}\n",
    )
    print0(body)
    return out / "report.md"
