"""Train a recipe into a run folder, in one process or under torchrun.

The config is built in this order, later winning: the recipe (`tngram recipes`), the --config
file (TOML or YAML; may name the recipe with `recipe = "..."`), --data, --steps, each --set.
Everything that can be checked without data or weights (recipe name, every key and value type,
config ranges) is checked before any work, with one error line listing what is valid.
`--print-config` prints the resolved config as a TOML file `--config` reads back, and exits.

    tngram train mini-tngram --out runs/x --set model.memory.cp_rank=64
    tngram train mini-raw --out runs/y --set model.memory.kind=tngram    # a memory on any recipe
    tngram train --config my.toml --out runs/z
    torchrun --standalone --nproc_per_node=2 -m tngram.train mini-tngram --out runs/x
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tngram.cli.argtypes import OneLineParser
from tngram.cli.common import (
    ALLOW_REPEAT,
    HelpFormatter,
    add_allow_repeat_argument,
    add_config_arguments,
    add_logger_argument,
    add_progress_argument,
    add_steps_argument,
    check_positive,
)
from tngram.common import TngramError
from tngram.train.recipes import resolve_config


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "recipe",
        nargs="?",
        default=None,
        metavar="RECIPE",
        help="a named recipe (see `tngram recipes`); optional when --config names one",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="run folder: config.json, metrics.jsonl, checkpoints, model.safetensors, "
        "tokenizer.model",
    )
    add_config_arguments(p)
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (TOML, readable by --config) and exit without training",
    )
    add_steps_argument(p, "the run's")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="stop after N optimiser steps of the (unchanged) schedule; --resume continues it",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the run folder's latest checkpoint"
    )
    p.add_argument(
        "--accept-changed-data",
        action="store_true",
        help="with --resume: continue although the dataset's fingerprint differs from the one "
        "the run recorded (both are kept in RUN/dataset.json)",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="dataset folder (default: the offline default corpus, built on first use; "
        "the paper recipes need FineWeb: docs/GPU.md)",
    )
    add_allow_repeat_argument(p)
    p.add_argument(
        "--device",
        default=None,
        metavar="D",
        help="auto | cpu | cuda | cuda:N | mps (same as --set run.device=D; default: the config's, "
        "auto)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads; 0 = torch's default: OMP_NUM_THREADS, else all cores, "
        "or fewer while other jobs keep the CPUs busy (a note says so; docs/TRAINING.md) "
        "(same as --set run.threads=N; default: the config's, 0)",
    )
    add_logger_argument(p)
    add_progress_argument(p)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a recipe (single process or under torchrun)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    check_positive("--steps", args.steps)
    check_positive("--stop-after", args.stop_after)
    sugar = ([f"run.device={args.device}"] if args.device is not None else []) + (
        [f"run.threads={args.threads}"] if args.threads is not None else []
    )
    if args.allow_repeat:
        sugar.append(ALLOW_REPEAT)
    cfg = resolve_config(args.recipe, sugar + args.overrides, args.data, args.config, args.steps)
    if args.print_config:
        from tngram.train.config_file import config_to_toml

        print(config_to_toml(cfg.to_dict(), _recipe_name(args)), end="")
        return 0
    if args.out is None:
        raise TngramError("--out DIR is required (the run folder)")
    if args.accept_changed_data and not args.resume:
        raise TngramError("--accept-changed-data only applies with --resume")
    from tngram.optim.muon import forced_muon_impl

    forced_muon_impl()  # a bad TNGRAM_MUON_IMPL stops here, before any model is built
    import os
    from tngram.train.loop import train
    from tngram.train.portable import ACCEPT_CHANGED_DATA_ENV

    before = os.environ.get(ACCEPT_CHANGED_DATA_ENV)
    if args.accept_changed_data:
        os.environ[ACCEPT_CHANGED_DATA_ENV] = "1"  # read where RUN/dataset.json is checked
    try:
        train(
            cfg,
            args.out,
            resume=args.resume,
            max_steps=args.stop_after,
            logger=args.logger,
            progress=False if args.no_progress else None,
        )
    finally:
        if before is None:
            os.environ.pop(ACCEPT_CHANGED_DATA_ENV, None)
        else:
            os.environ[ACCEPT_CHANGED_DATA_ENV] = before
    return 0


def _recipe_name(args: argparse.Namespace) -> str | None:
    if args.recipe is not None or args.config is None:
        return args.recipe
    from tngram.train.config_file import load_config_file

    return load_config_file(args.config)[0]


def main(argv: list[str] | None = None) -> int:
    """`python -m tngram.train RECIPE --out DIR ...`: the train command alone (for torchrun)."""
    parser = OneLineParser(
        prog="python -m tngram.train", description=__doc__, formatter_class=HelpFormatter
    )
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    from tngram.cli.safety import run_command

    return run_command(cmd_train, args)


if __name__ == "__main__":
    sys.exit(main())
