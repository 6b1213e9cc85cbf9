"""One CLI vocabulary: every command that has a flag of this name defines it here, so it means
the same thing everywhere (tests/test_cli_vocabulary.py checks the help texts).

    --steps N        total optimiser steps: the schedule's length (= --set schedule.steps=N)
    --json           a switch: print one JSON object on stdout instead of a table
    --out PATH       where results are written
    --threads N      torch CPU threads; 0 = torch's default (OMP_NUM_THREADS, else all cores)
    --device D       auto | cpu | cuda | cuda:N | mps; auto = cuda when available
    --preset P       the size of an experiment: cpu | paper (compare also paper-l9, paper-l18)
    --no-progress    no progress bars (also implied when stderr is not a terminal)
    --config FILE    a TOML or YAML file of config keys (the keys of --set)
    --set K=V        one config key (repeatable; applied after --config)
    --logger L       none | tensorboard | wandb (metrics.jsonl is always written)
"""

from __future__ import annotations

import argparse
import os
import sys

from tngram.cli.argtypes import int_range
from tngram.common import TngramError

LOGGERS = ("none", "tensorboard", "wandb")


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions: paragraphs are re-wrapped, except indented lines (examples), which are kept.
    Options: "(default: X)" is appended to every option that has a default worth showing (not
    None/False, and not already stated in the help)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for para in text.strip("\n").split("\n\n"):
            lines = para.split("\n")
            if any(line.startswith((" ", "\t")) for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(
                    textwrap.fill(
                        " ".join(line.strip() for line in lines),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
        ):
            return text
        if isinstance(action.default, list) and not action.default:
            return text
        return f"{text} (default: %(default)s)"


def use_formatter(parser: argparse.ArgumentParser) -> None:
    """HelpFormatter for `parser` and every sub-command under it."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_formatter(sub)


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | cuda:N | mps; auto = cuda when available (default: auto)",
    )


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int_range(0, 4096),
        default=0,
        metavar="N",
        help="torch CPU threads; 0 = torch's default: OMP_NUM_THREADS, else all cores "
        "(default: 0). On a shared CPU, fewer threads than cores is often faster.",
    )


def apply_threads(n: int) -> None:
    if n < 0:
        raise TngramError(f"--threads must be >= 0 (0 = torch's default), got {n}")
    if n > 0:
        import torch

        from tngram.common import check_thread_count

        check_thread_count(n, "--threads")
        torch.set_num_threads(n)


def use_threads(requested: int, device: str, doing: str) -> int:
    """Set torch's CPU threads by the rule `tngram train` uses (tngram.cpu.thread_rule: --threads
    N, else torch's default, fewer when other jobs keep the CPUs busy) and say in one line on
    stderr what was chosen; returns the thread count."""
    import torch

    from tngram.cpu import thread_rule

    apply_threads(requested)  # range and core-count checks of an explicit --threads
    kind = device.split(":")[0]
    if kind == "auto":  # as tngram.train.dist.resolve_device picks it
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    n, line = thread_rule(
        requested, kind, torch.get_num_threads(), doing, omp=os.environ.get("OMP_NUM_THREADS")
    )
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    if os.environ.get("RANK", "0") == "0":  # one line under torchrun too
        print(f"tngram: threads: {line}", file=sys.stderr, flush=True)
    return n


def add_json_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of a table"
    )


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (implied when stderr is not a terminal: then plain log lines)",
    )


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars only when asked for (no --no-progress) and stderr is a terminal."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def add_steps_argument(p: argparse.ArgumentParser, what: str = "each run's") -> None:
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help=f"total optimiser steps: {what} schedule length, warm-down scaled to match "
        f"(same as --set schedule.steps=N; default: the recipe's)",
    )


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML (.toml) or YAML (.yaml/.yml) file of config keys, the same keys as --set "
        "(see --print-config)",
    )
    add_set_argument(p)


def add_set_argument(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """--set SECTION.FIELD=VALUE (repeatable) into args.overrides; the one place it is declared."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help=help
        or "override one config key, e.g. --set optim.matrix_lr=0.02 or "
        "--set model.memory.kind=tngram (repeatable; applied after --config)",
    )


ALLOW_REPEAT = "data.allow_repeat=true"


def add_allow_repeat_argument(p: argparse.ArgumentParser) -> None:
    """--allow-repeat: the same as --set data.allow_repeat=true (appended to args.overrides by
    the command)."""
    p.add_argument(
        "--allow-repeat",
        action="store_true",
        help="train although the schedule reads the training data more than 4 times "
        "(refused otherwise, before training; same as --set data.allow_repeat=true)",
    )


def add_logger_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logger",
        choices=LOGGERS,
        default="none",
        help="also send metrics to TensorBoard (RUN/tb) or Weights & Biases (WANDB_MODE=offline "
        "works without an account); RUN/metrics.jsonl is always written (default: none)",
    )


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise TngramError(f"{name} must be >= 1, got {value}")
