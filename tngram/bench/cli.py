"""`tngram bench modules|step|data`: performance measurements (never part of the test suite).

Every subcommand prints a table, or with --json one JSON object. Figures, commands and the
machine they were taken on are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from tngram.argtypes import int_range


def _threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def _emit(res: dict[str, Any], text: str, args: argparse.Namespace) -> None:
    print(json.dumps(res, indent=1) if args.json else text)


def _modules(args: argparse.Namespace) -> int:
    from tngram.bench import modules
    _threads(args)
    names = tuple(args.only) if args.only else modules.CANDIDATES
    res = modules.run(names, batch=args.batch, seq=args.seq, reps=args.reps, warmup=args.warmup,
                      memory=not args.no_memory, profile=args.profile)
    _emit(res, modules.report(res), args)
    return 0


def _step(args: argparse.Namespace) -> int:
    from tngram.bench import step
    _threads(args)
    res = step.run(tuple(args.recipes) if args.recipes else step.DEFAULT_RECIPES,
                   reps=args.reps, warmup=args.warmup, dtypes=tuple(args.dtype),
                   paper_batch=args.paper_batch, profile=args.profile, compile=args.compile)
    _emit(res, step.report(res), args)
    return 0


def _data(args: argparse.Namespace) -> int:
    from tngram.bench import data
    _threads(args)
    res = data.run(tokens=args.tokens, reps=args.reps, batch=args.batch, seq=args.seq)
    _emit(res, data.report(res), args)
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("bench", help="performance benchmarks (modules, training step, data)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bs = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    bs.required = True

    def common(q: argparse.ArgumentParser, reps: int, warmup: int) -> None:
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.add_argument("--reps", type=int_range(1), default=reps, help=f"timed repetitions (default {reps})")
        q.add_argument("--warmup", type=int_range(0), default=warmup, help=f"untimed warm-up reps (default {warmup})")
        q.add_argument("--threads", type=int_range(0), default=0, help="torch threads (default: torch's)")

    m = bs.add_parser("modules", help="Engram / TN-gram / Over-Encoding alone at paper-l9 shapes")
    common(m, 15, 3)
    m.add_argument("--batch", type=int_range(1), default=4)
    m.add_argument("--seq", type=int_range(1), default=256)
    m.add_argument("--only", nargs="+", metavar="NAME",
                   help="candidates among none engram tngram tngram-torch tngram-ref oe")
    m.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    m.add_argument("--profile", action="store_true", help="add a per-op profile of the lookups")
    m.set_defaults(func=_modules)

    s = bs.add_parser("step", help="full training step: tokens/s and FLOP/s vs matmul peak")
    common(s, 8, 2)
    s.add_argument("--recipes", nargs="+", metavar="RECIPE", help="recipes (default: mini-* and paper-l9-*)")
    s.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    s.add_argument("--paper-batch", type=int_range(1), default=2, help="sequences of 1024 for paper-l9 (default 2)")
    s.add_argument("--profile", action="store_true", help="add a per-op profile of the mini steps")
    s.add_argument("--compile", action="store_true", help="also measure each step under torch.compile")
    s.set_defaults(func=_step)

    d = bs.add_parser("data", help="shard reading and tokenisation throughput")
    common(d, 5, 1)
    d.add_argument("--tokens", type=int_range(1), default=8_000_000, help="tokens in the synthetic shards")
    d.add_argument("--batch", type=int_range(1), default=16)
    d.add_argument("--seq", type=int_range(1), default=256)
    d.set_defaults(func=_data)
