"""CLI: `tngram compare ...` and `tngram experiment NAME ...`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.cli.argtypes import int_range
from tngram.cli.common import (
    HelpFormatter,
    add_progress_argument,
    add_set_argument,
    add_steps_argument,
)


MAX_SEEDS = 1000


def _common(
    p: Any,
    seeds_default: int | None = 1,
    seeds_help: str = "seeds per configuration (mean ± std in the report)",
) -> None:
    # at most MAX_SEEDS: a typo (1000000000) would otherwise plan runs until memory runs out
    p.add_argument("--seeds", type=int_range(1, MAX_SEEDS), default=seeds_default, help=seeds_help)
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="dataset folder (default: the offline default corpus, built on first use)",
    )
    add_steps_argument(p)
    add_set_argument(
        p,
        help="override a config key in every run, after the experiment's own settings, e.g. "
        "--set optim.matrix_lr=0.02 (repeatable; model.memory.* skips runs without a memory)",
    )
    p.add_argument(
        "--nproc",
        type=int_range(1),
        default=None,
        metavar="N",
        help="processes per run, torchrun when > 1 (default: 1 on CPU, all GPUs for paper presets)",
    )
    p.add_argument(
        "--jobs",
        type=int_range(1),
        default=1,
        metavar="J",
        help="CPU: train up to J runs at once, each with cores/J torch threads (or "
        "OMP_NUM_THREADS) and its output in RUN/worker.log (default 1)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="output folder: runs/, results.json, report.md (finished runs are reused)",
    )
    add_progress_argument(p)


_SEEDS_HELP = (
    "seeds per configuration (mean ± std in the report); default: 5 for corpora, 3 for "
    "data-scaling and adaptive-rank, 2 for tuning, 1 otherwise"
)


def _int_list(flag: str, text: str | None) -> tuple[int, ...] | None:
    """`--flag 1,2,4` -> (1, 2, 4); one clear error for anything but positive integers."""
    from tngram.common import TngramError

    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise TngramError(f"{flag} expects comma-separated positive integers, got {text!r}")
    return vals


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="raw GPT vs Engram vs TN-gram on the same data (paper Table 1)",
        description="Train the preset's raw, Engram and TN-gram recipes on one dataset "
        "and write a report (one row per method, mean ± std over seeds).",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=["cpu", "paper-l9", "paper-l18"],
        default="cpu",
        help="model size: cpu (minutes on a laptop), paper-l9, paper-l18 (GPUs)",
    )
    p.add_argument("--with-oe", action="store_true", help="also train Over-Encoding")
    _common(p)
    p.set_defaults(func=_cmd_compare)

    from tngram.experiments.sweeps import EXPERIMENTS

    p = sub.add_parser(
        "experiment",
        help="one paper figure or analysis: " + ", ".join(EXPERIMENTS),
        description="Run one experiment (a sweep of training runs, or an analysis) and "
        "write its table, figure and report under --out.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "name", choices=list(EXPERIMENTS), metavar="NAME", help="one of " + ", ".join(EXPERIMENTS)
    )
    p.add_argument(
        "--preset",
        choices=["cpu", "paper"],
        default="cpu",
        help="model size: cpu (mini recipes) or paper (paper-l9)",
    )
    _common(p, seeds_default=None, seeds_help=_SEEDS_HELP)  # None: each experiment's own count
    p.add_argument(
        "--budgets",
        default=None,
        metavar="K1,K2,...",
        help="data-scaling only: training budgets as multiples of the recipe's steps, "
        "comma-separated (default 1,4,16)",
    )
    p.add_argument(
        "--tuned",
        default=None,
        metavar="DIR|SETTINGS",
        help="corpora / data-scaling / pareto only: train each memory at the best setting of a "
        "finished `tngram experiment tuning --out DIR`, or at the settings it "
        "printed, e.g. engram-lr4,tngram-lr2 (table lr x 4 / x 2; pareto also oe-lrF)",
    )
    p.add_argument(
        "--core-max",
        type=int_range(1),
        default=None,
        metavar="N",
        help="pareto only: also score the first seed of every point of the default corpus (and "
        "its vocabulary-8192 setting) on the offline CORE bundle with --max-per-task N "
        "(`tngram eval build-bundle` first; the `eval` extra)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="pareto / table-update only: write the map / table from the runs finished so far; "
        "train nothing "
        "(the step/decode timing still runs once if OUT/bench.json is missing)",
    )
    p.add_argument(
        "--ranks",
        default=None,
        metavar="R1,R2,...",
        help="adaptive-rank only: fixed CP ranks to train, comma-separated (default 32,...,704)",
    )
    p.add_argument(
        "--corpora",
        default=None,
        metavar="NAME|DIR,...",
        help="corpora / data-scaling / pareto / table-update / dense / tuning only: built-in "
        "corpora (`tngram data build --corpus`) or dataset folders (`tngram data build "
        "--from-text TEXT --out DIR`; named by the folder's name in runs and results), "
        "comma-separated (default: default,literature,code for corpora and "
        "pareto and table-update, code-large for data-scaling)",
    )
    p.set_defaults(func=_cmd_experiment)


def _check(args: Any, prefix: str) -> None:
    import os

    if getattr(args, "no_progress", False):  # read by the worker subprocesses
        os.environ["TNGRAM_NO_PROGRESS"] = "1"
    from tngram.cli.common import check_positive
    from tngram.experiments.runner import check_jobs
    from tngram.train.recipes import get_recipe
    from tngram.train.config import apply_overrides

    check_positive("--seeds", args.seeds)
    check_positive("--steps", args.steps)
    check_positive("--nproc", args.nproc)
    check_jobs(args.jobs, args.nproc or 1)  # before any data or training work
    if args.overrides:  # bad keys/values fail before any data or training work
        apply_overrides(get_recipe(f"{prefix}-tngram"), args.overrides)


def _cmd_compare(args: Any) -> int:
    from tngram.experiments.common import PRESETS
    from tngram.experiments.compare import compare
    from tngram.experiments.runner import config_overrides, run_jobs

    _check(args, PRESETS[args.preset])
    with config_overrides(args.overrides), run_jobs(args.jobs):
        compare(
            args.preset,
            args.out,
            seeds=args.seeds,
            data=args.data,
            with_oe=args.with_oe,
            steps=args.steps,
            nproc=args.nproc,
        )
    return 0


def _cmd_experiment(args: Any) -> int:
    from tngram.experiments.common import SCALES
    from tngram.experiments.runner import config_overrides, run_jobs
    from tngram.experiments.sweeps import run_experiment
    from tngram.common import require_extra

    require_extra("matplotlib", "report", "`tngram experiment` figures")  # before any training
    require_extra("scipy", "report", "`tngram experiment` confidence intervals")
    _check(args, SCALES[args.preset])
    ranks = _int_list("--ranks", args.ranks)
    budgets = _int_list("--budgets", args.budgets)
    corpora = None
    if args.corpora is not None:
        from tngram.experiments.common import check_corpora

        corpora = check_corpora([c.strip() for c in args.corpora.split(",") if c.strip()])
    with config_overrides(args.overrides), run_jobs(args.jobs):
        run_experiment(
            args.name,
            args.out,
            scale=args.preset,
            seeds=args.seeds,
            data=args.data,
            steps=args.steps,
            nproc=args.nproc,
            ranks=ranks,
            corpora=corpora,
            budgets=budgets,
            tuned=args.tuned,
            report_only=args.report_only,
            core_max=args.core_max,
        )
    return 0
