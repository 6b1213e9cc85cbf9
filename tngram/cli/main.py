"""tngram: tensorized n-gram memories (TN-gram), Engram and Over-Encoding for GPT language models.

Train, evaluate and compare GPT models with n-gram memories. `tngram COMMAND --help` describes each
command; every option shows its default.

    tngram data build                                  # the offline default corpus (once)
    tngram train mini-tngram --out runs/mini           # one run (CPU: minutes)
    tngram sample runs/mini --prompt "The history of"
    tngram compare --preset cpu --out runs/compare     # raw vs Engram vs TN-gram
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tngram.cli.argtypes import OneLineParser

# Modules that define `add_commands(subparsers)`; each owns its subcommands.
_AREAS = (
    "tngram.cli.recipes",
    "tngram.cli.data",
    "tngram.cli.train",
    "tngram.cli.eval",
    "tngram.cli.sample",
    "tngram.cli.compare",
    "tngram.cli.export",
    "tngram.cli.doctor",
    "tngram.cli.plan",
)


def build_parser() -> argparse.ArgumentParser:
    from tngram import __version__
    from tngram.cli.common import use_formatter

    parser = OneLineParser(prog="tngram", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tngram {__version__}")
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
    use_formatter(parser)
    return parser


def _never_fail_on_odd_text() -> None:
    """stdout and stderr print undecodable bytes of a path or argument (surrogate escapes) as
    backslash escapes instead of raising UnicodeEncodeError in the middle of a message."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot be reconfigured: left as is
                pass


def main(argv: list[str] | None = None) -> int:
    from tngram.cli.safety import INTERRUPTED, run_command

    _never_fail_on_odd_text()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the commands load: one line too
        print(INTERRUPTED, file=sys.stderr, flush=True)
        return 130
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for results files
    return run_command(args.func, args)  # every failure is one line (tngram.cli.safety)


if __name__ == "__main__":
    sys.exit(main())
