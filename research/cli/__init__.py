"""`python -m research COMMAND`: the lab's commands (experiment, bench, report), parsed and run
with tngram's own CLI helpers so a flag and an error look the same as in `tngram`."""

from __future__ import annotations

import argparse
import sys

from tngram.cli.argtypes import OneLineParser
from tngram.cli.common import use_formatter

_AREAS = ("experiment", "bench", "report")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = OneLineParser(prog="python -m research", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _AREAS:
        importlib.import_module(f"research.cli.{name}").add_commands(sub)
    use_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tngram.cli.safety import run_command

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for results files
    return run_command(args.func, args)
