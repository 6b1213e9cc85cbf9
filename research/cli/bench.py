"""`python -m research bench modules|threads|step|trainer|vocab|data|decode|contention|gpu`:
performance
measurements.

Every subcommand prints a table, or with --json one JSON object. Figures, commands and the
machine they were taken on are in research/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tngram.cli.argtypes import float_range, int_range
from research.cli.bench_args import (
    add_batch_seq,
    add_common,
    add_data_dir,
    add_recipes,
    add_stop_after,
    add_timing,
    results_file_fields,
)
from tngram.cli.common import add_json_argument

# optim.memory_update options, "+catchup" with optim.memory_catchup
# (research.bench.vocab.UPDATE_CHOICES;
# spelled out here so that building the parser does not import torch)
TABLE_UPDATES = ("dense", "sparse", "rowwise", "sparse+catchup", "rowwise+catchup")


def _threads(args: argparse.Namespace) -> None:
    """Train's thread rule (tngram.cpu.thread_rule), said in one line on stderr: a benchmark
    on a busy machine runs, and reports, the threads a training run there would use."""
    from tngram.cli.common import use_threads

    use_threads(args.threads, vars(args).get("device") or "cpu", "benchmarking")


def _emit(
    res: dict[str, Any], text: str, args: argparse.Namespace, kind: str | None = None
) -> None:
    """Print the table, or with --json the result (with `kind`: and its results_file_fields)."""
    if kind is not None:
        res = dict(res, **results_file_fields(kind, getattr(args, "argv", [])))
    print(json.dumps(res, indent=1) if args.json else text)


def _modules(args: argparse.Namespace) -> int:
    from research.bench import modules

    _threads(args)
    names = tuple(args.only) if args.only else modules.CANDIDATES
    res = modules.run(
        names,
        batch=args.batch,
        seq=args.seq,
        reps=args.reps,
        warmup=args.warmup,
        memory=not args.no_memory,
        profile=args.profile,
    )
    _emit(res, modules.report(res), args)
    return 0


def _threads_bench(args: argparse.Namespace) -> int:
    from research.bench import threads

    if args.kernel_share:
        res = threads.kernel_share(args.batch, args.seq, args.reps)
        print(json.dumps(res, indent=1))
        return 0
    res = threads.run(
        tuple(args.threads_list),
        batch=args.batch,
        seq=args.seq,
        reps=args.reps,
        warmup=args.warmup,
        steps=not args.no_steps,
    )
    _emit(res, threads.report(res), args, "bench-threads")
    return 0


def _contention(args: argparse.Namespace) -> int:
    from research.bench import contention

    res = contention.run(
        args.recipe,
        reps=args.reps,
        warmup=args.warmup,
        steps=args.steps_per_rep,
        competitor_threads=args.competitor_threads,
    )
    _emit(res, contention.report(res), args, "bench-contention")
    return 0


def _step(args: argparse.Namespace) -> int:
    from research.bench import step

    _threads(args)
    res = step.run(
        tuple(args.recipes) if args.recipes else step.DEFAULT_RECIPES,
        reps=args.reps,
        warmup=args.warmup,
        dtypes=tuple(args.dtype),
        paper_batch=args.paper_batch,
        profile=args.profile,
        compile=args.compile,
    )
    _emit(res, step.report(res), args)
    return 0


def _vocab(args: argparse.Namespace) -> int:
    from research.bench import vocab

    _threads(args)
    res = vocab.run(
        tuple(args.vocabs),
        reps=args.reps,
        warmup=args.warmup,
        updates=tuple(args.updates),
        max_gb=args.max_gb,
        peak=not args.no_peak,
        threads=args.threads or 1,
        large_reps=args.large_reps,
        peak_max_vocab=args.peak_max_vocab,
        large_updates=tuple(args.large_updates) if args.large_updates else None,
        say=(lambda *a: None) if args.json else print,
    )
    _emit(res, vocab.report(res), args, "bench-vocab")
    return 0


def _trainer(args: argparse.Namespace) -> int:
    from research.bench import trainer

    _threads(args)
    if args.gap:
        res = trainer.gap(tuple(args.recipes[:2]), reps=args.reps, warmup=args.warmup)
        _emit(res, trainer.report_gap(res), args, "bench-trainer-gap")
        return 0
    import torch
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # the runs' own lines; stdout is the result
        rows = [
            trainer.phases(r, args.stop_after, torch.get_num_threads(), args.data)
            for r in args.recipes
        ]
    from research.bench.common import machine_info

    res = {
        "benchmark": "trainer-phases",
        "machine": machine_info(),
        "runs": rows,
    }
    _emit(res, trainer.report_phases(rows), args, "bench-trainer-phases")
    return 0


def _data(args: argparse.Namespace) -> int:
    from research.bench import data

    _threads(args)
    res = data.run(
        tokens=args.tokens, reps=args.reps, batch=args.batch, seq=args.seq, dataset=args.dir
    )
    _emit(res, data.report(res), args)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from research.bench import decode

    _threads(args)
    res = decode.run(
        tuple(args.shapes),
        tuple(args.methods),
        tokens=args.tokens,
        prompt_len=args.prompt,
        reps=args.reps,
        warmup=args.warmup,
        hf=not args.no_hf,
    )
    _emit(res, decode.report(res), args)
    return 0


def _add_modules(bs: Any) -> None:
    m = bs.add_parser("modules", help="Engram / TN-gram / Over-Encoding alone at paper-l9 shapes")
    add_common(m, 15, 3)
    add_batch_seq(m, 4, "sequences per forward")
    m.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="candidates among none engram tngram tngram-torch tngram-ref oe",
    )
    m.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    m.add_argument("--profile", action="store_true", help="add a per-op profile of the lookups")
    m.set_defaults(func=_modules)


def _add_threads(bs: Any) -> None:
    t = bs.add_parser(
        "threads",
        help="TN-gram vs Engram lookup/module/mini step at several thread "
        "counts, interleaved in one process, with speed-ups",
    )
    add_json_argument(t)
    add_timing(t, 15, 3)
    t.add_argument(
        "--threads-list",
        type=int_range(1, 4096),
        nargs="+",
        default=[1, 2],
        metavar="T",
        help="thread counts to interleave (default 1 2)",
    )
    add_batch_seq(t, 4, "sequences per lookup/module forward")
    t.add_argument("--no-steps", action="store_true", help="skip the mini training steps")
    t.add_argument(
        "--kernel-share",
        action="store_true",
        help="instead: the share of TN-gram's lookup inside the parallel C ops at 1 thread "
        "(min of --reps) and the Amdahl speed-ups it implies",
    )
    t.set_defaults(func=_threads_bench)


def _add_contention(bs: Any) -> None:
    ct = bs.add_parser(
        "contention",
        help="training tokens/s alone and beside a competing 2-thread torch "
        "job, at torch's default threads, 1 thread and the automatic "
        "choice, interleaved (research/PERFORMANCE.md)",
    )
    add_json_argument(ct)
    ct.add_argument(
        "--recipe",
        default="mini-tngram",
        metavar="RECIPE",
        help="recipe whose step is timed (default: mini-tngram)",
    )
    add_timing(ct, 5, 1, say_default=True)
    ct.add_argument(
        "--steps-per-rep",
        type=int_range(1),
        default=2,
        metavar="N",
        help="optimiser steps timed per rep (default: 2)",
    )
    ct.add_argument(
        "--competitor-threads",
        type=int_range(1, 64),
        default=2,
        metavar="N",
        help="torch threads of the competing job (default: 2)",
    )
    ct.set_defaults(func=_contention)


def _add_step(bs: Any) -> None:
    s = bs.add_parser("step", help="full training step: tokens/s and FLOP/s vs matmul peak")
    add_common(s, 8, 2)
    add_recipes(s, "recipes (default: mini-* and paper-l9-*)")
    s.add_argument(
        "--dtype",
        nargs="+",
        choices=("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="precisions to measure",
    )
    s.add_argument(
        "--paper-batch", type=int_range(1), default=2, help="sequences of 1024 tokens for paper-l9"
    )
    s.add_argument("--profile", action="store_true", help="add a per-op profile of the mini steps")
    s.add_argument(
        "--compile", action="store_true", help="also measure each step under torch.compile"
    )
    s.set_defaults(func=_step)


def _add_vocab(bs: Any) -> None:
    v = bs.add_parser(
        "vocab",
        help="training step vs vocabulary size (1k-128k): raw, Engram, TN-gram "
        "x optim.memory_update dense/sparse/rowwise; optimiser-state "
        "bytes per table parameter, peak RSS",
    )
    add_common(v, 5, 1)
    v.add_argument(
        "--vocabs",
        nargs="+",
        type=int_range(2),
        default=[1024, 8192, 32768, 131072],
        metavar="V",
        help="vocabulary sizes (default: 1024 8192 32768 131072)",
    )
    v.add_argument(
        "--updates",
        nargs="+",
        choices=TABLE_UPDATES,
        default=["dense", "sparse", "rowwise"],
        help="table update options to time",
    )
    v.add_argument(
        "--max-gb",
        type=float_range(0.0, lo_open=True),
        default=8.0,
        metavar="GB",
        help="memory budget of one interleaved group (weights + grads + state, estimated)",
    )
    v.add_argument(
        "--large-reps",
        type=int_range(1),
        default=3,
        metavar="N",
        help="timed repetitions at V >= 65536 (a step takes tens of seconds there)",
    )
    v.add_argument(
        "--large-updates",
        nargs="+",
        choices=TABLE_UPDATES,
        default=None,
        help="table update options timed at V >= 65536 (default: --updates)",
    )
    v.add_argument(
        "--peak-max-vocab",
        type=int_range(2),
        default=32768,
        metavar="V",
        help="measure peak RSS up to this vocabulary (default 32768)",
    )
    v.add_argument("--no-peak", action="store_true", help="skip the peak-RSS subprocess runs")
    v.set_defaults(func=_vocab)


def _add_trainer(bs: Any) -> None:
    tr = bs.add_parser(
        "trainer",
        help="where a real training run's time goes (data, forward, backward, "
        "optimisers, eval, checkpoints); --gap: TN-gram's step gap to "
        "Engram split into extra matmul arithmetic and the rest",
    )
    add_common(tr, 11, 2)
    add_recipes(
        tr,
        "recipes (default mini-tngram mini-engram; --gap uses the first two)",
        default=["mini-tngram", "mini-engram"],
    )
    add_stop_after(
        tr, 1, 128, "stop each run after N optimiser steps of the recipe's (unchanged) schedule"
    )
    add_data_dir(tr, "dataset folder (default: the default corpus)")
    tr.add_argument(
        "--gap",
        action="store_true",
        help="instead: interleaved step, K/V matmul and Muon NS times and the gap split",
    )
    tr.set_defaults(func=_trainer)


def _add_data(bs: Any) -> None:
    d = bs.add_parser(
        "data",
        help="data loader (shard reading) and tokenisation throughput",
        description="Loader throughput (tokens/s of training batches read from shards, page "
        "cache warm) and tokenisation throughput. Without DIR: synthetic shards and the "
        "default corpus's tokenizer; with DIR: that dataset's train shards and tokenizer.",
    )
    d.add_argument(
        "dir",
        nargs="?",
        default=None,
        metavar="DIR",
        help="a dataset folder to read (default: synthetic shards)",
    )
    add_common(d, 5, 1)
    d.add_argument(
        "--tokens", type=int_range(1), default=8_000_000, help="tokens in the synthetic shards"
    )
    add_batch_seq(d, 16, "sequences per batch")
    d.set_defaults(func=_data)


def _add_decode(bs: Any) -> None:
    c = bs.add_parser(
        "decode",
        help="incremental decoding tokens/s: raw, Engram, TN-gram (ours and HF "
        "generate) with the per-token FLOP ratio",
    )
    add_common(c, 5, 1)
    c.add_argument(
        "--shapes",
        nargs="+",
        choices=("mini", "paper-l9"),
        default=["mini", "paper-l9"],
        help="model sizes to measure",
    )
    c.add_argument(
        "--methods",
        nargs="+",
        choices=("raw", "engram", "tngram"),
        default=["raw", "engram", "tngram"],
        help="memories to measure",
    )
    c.add_argument("--tokens", type=int_range(1), default=64, help="new tokens per rep")
    c.add_argument("--prompt", type=int_range(1), default=16, help="prompt length")
    c.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate path")
    c.set_defaults(func=_decode)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="performance benchmarks (modules, training step, data)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bs = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    bs.required = True
    _add_modules(bs)
    _add_threads(bs)
    _add_contention(bs)
    _add_step(bs)
    _add_vocab(bs)
    _add_trainer(bs)
    _add_data(bs)
    _add_decode(bs)
    from research.cli.bench_gpu import add_gpu_command  # its own file: the longest subcommand

    add_gpu_command(bs)
