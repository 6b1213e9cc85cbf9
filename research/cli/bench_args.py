"""The flags several `python -m research bench` subcommands take, each defined once, and the fields
every
benchmark results file carries (shared by research/cli/bench.py and research/cli/bench_gpu.py)."""

from __future__ import annotations

import argparse
from typing import Any

from tngram.cli.argtypes import int_range
from tngram.cli.common import add_json_argument, add_threads_argument


def results_file_fields(kind: str, argv: list[str]) -> dict[str, Any]:
    """kind, command and commit, so that `--json` output can be committed as
    research/results/NAME.json
    and shown in the docs as generated tables (research.report.docblocks)."""
    import shlex
    from pathlib import Path

    from tngram.train.metrics import git_info

    git = git_info(Path(__file__).resolve().parent)
    commit = (git.get("commit") or "unknown")[:7] + (
        " (with uncommitted changes)" if git.get("dirty") else ""
    )
    return {"kind": kind, "command": "python -m research " + shlex.join(argv), "commit": commit}


MAX_REPS, MAX_WARMUP = 10_000, 1_000  # a timing that repeats more is a typo, not a measurement


def add_reps(q: argparse.ArgumentParser, default: int | None, help: str) -> None:
    q.add_argument("--reps", type=int_range(1, MAX_REPS), default=default, help=help)


def add_timing(
    q: argparse.ArgumentParser, reps: int, warmup: int, say_default: bool = False
) -> None:
    """--reps and --warmup (their defaults spelled out in the help with say_default)."""
    r, w = (f" (default: {reps})", f" (default: {warmup})") if say_default else ("", "")
    add_reps(q, reps, "timed repetitions" + r)
    q.add_argument(
        "--warmup",
        type=int_range(0, MAX_WARMUP),
        default=warmup,
        help="untimed warm-up repetitions" + w,
    )


def add_common(q: argparse.ArgumentParser, reps: int, warmup: int) -> None:
    """--json, --reps, --warmup and --threads (train's thread rule)."""
    add_json_argument(q)
    add_timing(q, reps, warmup)
    add_threads_argument(q)


def add_batch_seq(q: argparse.ArgumentParser, batch: int, batch_help: str) -> None:
    q.add_argument("--batch", type=int_range(1), default=batch, help=batch_help)
    q.add_argument("--seq", type=int_range(1), default=256, help="tokens per sequence")


def add_recipes(q: argparse.ArgumentParser, help: str, default: list[str] | None = None) -> None:
    q.add_argument("--recipes", nargs="+", metavar="RECIPE", default=default, help=help)


def add_stop_after(q: argparse.ArgumentParser, lo: int, default: int, help: str) -> None:
    q.add_argument("--stop-after", type=int_range(lo), default=default, metavar="N", help=help)


def add_data_dir(q: argparse.ArgumentParser, help: str) -> None:
    q.add_argument("--data", metavar="DIR", help=help)
