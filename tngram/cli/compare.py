"""CLI: `tngram compare ...` (paper Table 1: raw GPT vs Engram vs TN-gram on one dataset)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.cli.argtypes import int_range
from tngram.cli.common import (
    ALLOW_REPEAT,
    HelpFormatter,
    add_allow_repeat_argument,
    add_progress_argument,
    add_set_argument,
    add_steps_argument,
)


MAX_SEEDS = 1000


def add_run_arguments(
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
    add_allow_repeat_argument(p)
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
    add_run_arguments(p)
    p.set_defaults(func=_cmd_compare)


def check_run_args(args: Any, prefix: str) -> None:
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
    if getattr(args, "allow_repeat", False) and ALLOW_REPEAT not in args.overrides:
        args.overrides.append(ALLOW_REPEAT)
    check_jobs(args.jobs, args.nproc or 1)  # before any data or training work
    if args.overrides:  # bad keys/values fail before any data or training work
        apply_overrides(get_recipe(f"{prefix}-tngram"), args.overrides)


def _cmd_compare(args: Any) -> int:
    from tngram.experiments.common import PRESETS
    from tngram.experiments.compare import compare
    from tngram.experiments.runner import config_overrides, run_jobs

    check_run_args(args, PRESETS[args.preset])
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
