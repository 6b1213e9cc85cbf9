"""`python -m research experiment NAME ...`: one paper figure or analysis (a sweep of training
runs through tngram's compare runner, then its table, figure and report)."""

from __future__ import annotations

from typing import Any

from tngram.cli.argtypes import int_range
from tngram.cli.common import HelpFormatter
from tngram.cli.compare import add_run_arguments, check_run_args


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
    from research.experiments.sweeps import EXPERIMENTS

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
    # seeds None: each experiment's own count
    add_run_arguments(p, seeds_default=None, seeds_help=_SEEDS_HELP)
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
        "finished `python -m research experiment tuning --out DIR`, or at the settings it "
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


def _cmd_experiment(args: Any) -> int:
    from research.experiments.common import SCALES
    from tngram.experiments.runner import config_overrides, run_jobs
    from research.experiments.sweeps import run_experiment
    from tngram.common import require_extra

    # before any training
    require_extra("matplotlib", "report", "`python -m research experiment` figures")
    require_extra("scipy", "report", "`python -m research experiment` confidence intervals")
    check_run_args(args, SCALES[args.preset])
    ranks = _int_list("--ranks", args.ranks)
    budgets = _int_list("--budgets", args.budgets)
    corpora = None
    if args.corpora is not None:
        from research.experiments.common import check_corpora

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
