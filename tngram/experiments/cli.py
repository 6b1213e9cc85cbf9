"""CLI: `tngram compare ...` and `tngram experiment NAME ...`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.argtypes import int_range


def add_commands(sub: Any) -> None:
    p = sub.add_parser("compare", help="raw GPT vs Engram vs TN-gram on the same data (paper Table 1)")
    p.add_argument("--preset", choices=["cpu", "paper-l9", "paper-l18"], default="cpu")
    p.add_argument("--seeds", type=int_range(1), default=1, help="seeds per method (mean ± std in the report)")
    p.add_argument("--data", default=None, help="dataset folder (default: the offline corpus, built if missing)")
    p.add_argument("--with-oe", action="store_true", help="also train Over-Encoding")
    p.add_argument("--steps", type=int_range(1), default=None, help="override the recipe's step count")
    p.add_argument("--nproc", type=int_range(1), default=None, help="processes per run (torchrun when > 1)")
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=_cmd_compare)

    from tngram.experiments.sweeps import EXPERIMENTS
    p = sub.add_parser("experiment", help="one paper figure or analysis: " + ", ".join(EXPERIMENTS))
    p.add_argument("name", choices=list(EXPERIMENTS))
    p.add_argument("--scale", choices=["cpu", "paper"], default="cpu")
    p.add_argument("--seeds", type=int_range(1), default=1)
    p.add_argument("--data", default=None)
    p.add_argument("--steps", type=int_range(1), default=None)
    p.add_argument("--nproc", type=int_range(1), default=None)
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=_cmd_experiment)


def _cmd_compare(args: Any) -> int:
    from tngram.common import TngramError
    from tngram.experiments.compare import compare
    if args.seeds < 1:
        raise TngramError(f"--seeds must be >= 1, got {args.seeds}")
    compare(args.preset, args.out, seeds=args.seeds, data=args.data, with_oe=args.with_oe,
            steps=args.steps, nproc=args.nproc)
    return 0


def _cmd_experiment(args: Any) -> int:
    from tngram.experiments.sweeps import run_experiment
    run_experiment(args.name, args.out, scale=args.scale, seeds=args.seeds, data=args.data,
                   steps=args.steps, nproc=args.nproc)
    return 0
