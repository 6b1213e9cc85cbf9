"""`tngram train RECIPE --out DIR [--steps N] [--resume] [--data DIR] [--set section.field=value ...]`.

Everything that can be checked without data or weights (recipe name, every --set key and value
type, config ranges) is checked before any work, with a TngramError listing what is valid.
The same arguments work under torchrun through `python -m tngram.train` (tngram/train/__main__.py):

    torchrun --standalone --nproc_per_node=2 -m tngram.train mini-tngram --out runs/x
"""

from __future__ import annotations

import argparse
from typing import Any

from tngram.common import TngramError


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="a named recipe (see `tngram recipes`)")
    p.add_argument("--out", required=True, help="run folder (config.json, metrics.jsonl, checkpoints, summary.json)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after N optimiser steps of the recipe's schedule (the schedule is not "
                        "shortened; use --set schedule.steps=N for that)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--data", default=None, help="dataset folder (default: build/use the default corpus)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set optim.matrix_lr=0.02 (repeatable)")


def add_commands(sub: Any) -> None:
    p = sub.add_parser("train", help="train a recipe (single process or under torchrun)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)


def resolve_config(recipe: str, overrides: list[str], data: str | None = None):
    """The recipe's TrainConfig with --data and --set applied and validated (no work done)."""
    from dataclasses import replace

    from tngram.recipes import get_recipe
    from tngram.train.config import apply_overrides

    cfg = get_recipe(recipe)
    if data is not None:
        cfg = replace(cfg, data=replace(cfg.data, dir=str(data)))
    return apply_overrides(cfg, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise TngramError(f"--steps must be >= 1, got {args.steps}")
    cfg = resolve_config(args.recipe, args.overrides, args.data)
    from tngram.train.loop import train
    train(cfg, args.out, resume=args.resume, max_steps=args.steps)
    return 0
