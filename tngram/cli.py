"""The `tngram` command. Each area registers its own subcommands (`add_commands(subparsers)`)."""

from __future__ import annotations

import argparse
import importlib
import sys

from tngram.argtypes import OneLineParser, report_error
from tngram.common import TngramError

# Modules that define `add_commands(subparsers)`; each owns its subcommands.
_AREAS = (
    "tngram.recipes",
    "tngram.data.cli",
    "tngram.train.cli",
    "tngram.eval.cli",
    "tngram.eval.sample",
    "tngram.experiments.cli",
    "tngram.report.cli",
    "tngram.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tngram", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _AREAS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:  # an area not built yet
            if e.name == name:
                continue
            raise
        mod.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except (TngramError, OSError) as e:  # user/environment errors: one line, exit 2
        print(f"tngram: error: {report_error(e)}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
