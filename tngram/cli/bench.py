"""`tngram bench modules|threads|step|trainer|vocab|data|decode|contention|gpu`: performance
measurements.

Every subcommand prints a table, or with --json one JSON object. Figures, commands and the
machine they were taken on are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tngram.cli.argtypes import float_range, int_range
from tngram.cli.common import add_json_argument, add_set_argument, add_threads_argument

# optim.memory_update options, "+catchup" with optim.memory_catchup
# (tngram.bench.vocab.UPDATE_CHOICES;
# spelled out here so that building the parser does not import torch)
TABLE_UPDATES = ("dense", "sparse", "rowwise", "sparse+catchup", "rowwise+catchup")
# tngram.bench.gpu.SECTIONS, in its order (tests/test_bench_gpu.py checks they agree)
GPU_SECTIONS = ("doctor", "lookup", "kernels", "fwdbwd", "tables", "trainer")
# tngram.kernels.policy.TRITON_BACKWARDS (the same test checks it)
TRITON_BACKWARDS = ("fused", "split")


def _threads(args: argparse.Namespace) -> None:
    """Train's thread rule (tngram.cpu.thread_rule), said in one line on stderr: a benchmark
    on a busy machine runs, and reports, the threads a training run there would use."""
    from tngram.cli.common import use_threads

    use_threads(args.threads, vars(args).get("device") or "cpu", "benchmarking")


def results_file_fields(kind: str, argv: list[str]) -> dict[str, Any]:
    """kind, command and commit, so that `--json` output can be committed as docs/results/NAME.json
    and shown in the docs as generated tables (tngram.report.docblocks)."""
    import shlex
    from pathlib import Path

    from tngram.train.metrics import git_info

    git = git_info(Path(__file__).resolve().parent)
    commit = (git.get("commit") or "unknown")[:7] + (
        " (with uncommitted changes)" if git.get("dirty") else ""
    )
    return {"kind": kind, "command": "tngram " + shlex.join(argv), "commit": commit}


def _emit(
    res: dict[str, Any], text: str, args: argparse.Namespace, kind: str | None = None
) -> None:
    """Print the table, or with --json the result (with `kind`: and its results_file_fields)."""
    if kind is not None:
        res = dict(res, **results_file_fields(kind, getattr(args, "argv", [])))
    print(json.dumps(res, indent=1) if args.json else text)


def _modules(args: argparse.Namespace) -> int:
    from tngram.bench import modules

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
    from tngram.bench import threads

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
    from tngram.bench import contention

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
    from tngram.bench import step

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
    from tngram.bench import vocab

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
    from tngram.bench import trainer

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
    from tngram.bench.common import machine_info

    res = {
        "benchmark": "trainer-phases",
        "machine": machine_info(),
        "runs": rows,
    }
    _emit(res, trainer.report_phases(rows), args, "bench-trainer-phases")
    return 0


def _data(args: argparse.Namespace) -> int:
    from tngram.bench import data

    _threads(args)
    res = data.run(
        tokens=args.tokens, reps=args.reps, batch=args.batch, seq=args.seq, dataset=args.dir
    )
    _emit(res, data.report(res), args)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from tngram.bench import decode

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


def _gpu_out(out: str | None, slug: str) -> Any:
    """The results file: --out FILE.json, or gpu-<card>.json in --out DIR (default docs/results)."""
    from pathlib import Path

    from tngram.common import TngramError

    p = Path(out) if out else Path("docs/results")
    path = p if p.suffix == ".json" else p / f"gpu-{slug}.json"
    if not path.parent.is_dir():
        raise TngramError(f"--out: folder {path.parent} does not exist")
    return path


def _gpu(args: argparse.Namespace) -> int:
    """Validate everything before any measurement (exit 2 on bad input), then run and write."""
    import torch

    from tngram.bench import gpu
    from tngram.cli.doctor import diagnose
    from tngram.common import TngramError, atomic_write_json
    from tngram.train.recipes import recipe_names

    known = recipe_names()
    bad = [r for r in args.recipes or [] if r not in known or not r.startswith("paper-l9-")]
    if bad:
        raise TngramError(f"--recipes: {bad} are not paper-l9-* recipes (`tngram recipes`)")
    if args.data is not None:
        from tngram.data.dataset import open_dataset

        open_dataset(args.data)  # a clear error now rather than after the other sections
    if args.overrides:  # a bad --set stops here, not after the other sections
        from tngram.train.recipes import resolve_config

        for r in args.recipes or gpu.paper_recipes(known):
            resolve_config(r, list(args.overrides))
    policy = {
        "triton_backward": args.triton_backward,
        "triton_backward_warps": args.triton_backward_warps,
    }
    from tngram.kernels import kernel_policy

    try:  # the policy's own check (a power of two), before any measurement
        with kernel_policy(**policy):
            pass
    except ValueError as e:
        raise TngramError(f"--triton-backward-warps: {e}") from None
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    path = _gpu_out(args.out, gpu.card_slug(card))
    if path.exists() and not args.force:
        raise TngramError(f"--out: {path} exists (pass --force to replace it)")
    fields = results_file_fields("bench-gpu", getattr(args, "argv", []))

    def save(res: dict[str, Any]) -> None:
        res.update(fields)
        res["machine"] = (
            f"{res['card']}"
            + (
                f" ({res['card_memory_gb']} GiB, driver {res['driver']})"
                if res.get("driver")
                else ""
            )
            + f", torch {res['torch']}, triton {res['triton'] or 'none'}"
        )
        atomic_write_json(path, res)

    res = gpu.run(
        budget_s=args.budget,
        recipes=args.recipes,
        sections=tuple(args.sections),
        steps=args.stop_after,
        data=args.data,
        reps=args.reps,
        compile=not args.no_compile,
        profile=args.profile,
        trainer_sets=tuple(args.overrides),
        policy=policy,
        doctor=diagnose,
        say=lambda line: print(line, flush=True),
        save=save,
    )
    save(res)
    print(gpu.report(res))
    print(f"wrote {path}")
    return 0


# ---- arguments: each flag that several subcommands take is defined once, here ---------------
MAX_REPS, MAX_WARMUP = 10_000, 1_000  # a timing that repeats more is a typo, not a measurement


def _reps(q: argparse.ArgumentParser, default: int | None, help: str) -> None:
    q.add_argument("--reps", type=int_range(1, MAX_REPS), default=default, help=help)


def _timing(q: argparse.ArgumentParser, reps: int, warmup: int, say_default: bool = False) -> None:
    """--reps and --warmup (their defaults spelled out in the help with say_default)."""
    r, w = (f" (default: {reps})", f" (default: {warmup})") if say_default else ("", "")
    _reps(q, reps, "timed repetitions" + r)
    q.add_argument(
        "--warmup",
        type=int_range(0, MAX_WARMUP),
        default=warmup,
        help="untimed warm-up repetitions" + w,
    )


def _common(q: argparse.ArgumentParser, reps: int, warmup: int) -> None:
    """--json, --reps, --warmup and --threads (train's thread rule)."""
    add_json_argument(q)
    _timing(q, reps, warmup)
    add_threads_argument(q)


def _batch_seq(q: argparse.ArgumentParser, batch: int, batch_help: str) -> None:
    q.add_argument("--batch", type=int_range(1), default=batch, help=batch_help)
    q.add_argument("--seq", type=int_range(1), default=256, help="tokens per sequence")


def _recipes(q: argparse.ArgumentParser, help: str, default: list[str] | None = None) -> None:
    q.add_argument("--recipes", nargs="+", metavar="RECIPE", default=default, help=help)


def _stop_after(q: argparse.ArgumentParser, lo: int, default: int, help: str) -> None:
    q.add_argument("--stop-after", type=int_range(lo), default=default, metavar="N", help=help)


def _data_dir(q: argparse.ArgumentParser, help: str) -> None:
    q.add_argument("--data", metavar="DIR", help=help)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="performance benchmarks (modules, training step, data)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bs = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    bs.required = True

    m = bs.add_parser("modules", help="Engram / TN-gram / Over-Encoding alone at paper-l9 shapes")
    _common(m, 15, 3)
    _batch_seq(m, 4, "sequences per forward")
    m.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="candidates among none engram tngram tngram-torch tngram-ref oe",
    )
    m.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    m.add_argument("--profile", action="store_true", help="add a per-op profile of the lookups")
    m.set_defaults(func=_modules)

    t = bs.add_parser(
        "threads",
        help="TN-gram vs Engram lookup/module/mini step at several thread "
        "counts, interleaved in one process, with speed-ups",
    )
    add_json_argument(t)
    _timing(t, 15, 3)
    t.add_argument(
        "--threads-list",
        type=int_range(1, 4096),
        nargs="+",
        default=[1, 2],
        metavar="T",
        help="thread counts to interleave (default 1 2)",
    )
    _batch_seq(t, 4, "sequences per lookup/module forward")
    t.add_argument("--no-steps", action="store_true", help="skip the mini training steps")
    t.add_argument(
        "--kernel-share",
        action="store_true",
        help="instead: the share of TN-gram's lookup inside the parallel C ops at 1 thread "
        "(min of --reps) and the Amdahl speed-ups it implies",
    )
    t.set_defaults(func=_threads_bench)

    ct = bs.add_parser(
        "contention",
        help="training tokens/s alone and beside a competing 2-thread torch "
        "job, at torch's default threads, 1 thread and the automatic "
        "choice, interleaved (docs/PERFORMANCE.md)",
    )
    add_json_argument(ct)
    ct.add_argument(
        "--recipe",
        default="mini-tngram",
        metavar="RECIPE",
        help="recipe whose step is timed (default: mini-tngram)",
    )
    _timing(ct, 5, 1, say_default=True)
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

    s = bs.add_parser("step", help="full training step: tokens/s and FLOP/s vs matmul peak")
    _common(s, 8, 2)
    _recipes(s, "recipes (default: mini-* and paper-l9-*)")
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

    v = bs.add_parser(
        "vocab",
        help="training step vs vocabulary size (1k-128k): raw, Engram, TN-gram "
        "x optim.memory_update dense/sparse/rowwise; optimiser-state "
        "bytes per table parameter, peak RSS",
    )
    _common(v, 5, 1)
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

    tr = bs.add_parser(
        "trainer",
        help="where a real training run's time goes (data, forward, backward, "
        "optimisers, eval, checkpoints); --gap: TN-gram's step gap to "
        "Engram split into extra matmul arithmetic and the rest",
    )
    _common(tr, 11, 2)
    _recipes(
        tr,
        "recipes (default mini-tngram mini-engram; --gap uses the first two)",
        default=["mini-tngram", "mini-engram"],
    )
    _stop_after(
        tr, 1, 128, "stop each run after N optimiser steps of the recipe's (unchanged) schedule"
    )
    _data_dir(tr, "dataset folder (default: the default corpus)")
    tr.add_argument(
        "--gap",
        action="store_true",
        help="instead: interleaved step, K/V matmul and Muon NS times and the gap split",
    )
    tr.set_defaults(func=_trainer)

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
    _common(d, 5, 1)
    d.add_argument(
        "--tokens", type=int_range(1), default=8_000_000, help="tokens in the synthetic shards"
    )
    _batch_seq(d, 16, "sequences per batch")
    d.set_defaults(func=_data)

    c = bs.add_parser(
        "decode",
        help="incremental decoding tokens/s: raw, Engram, TN-gram (ours and HF "
        "generate) with the per-token FLOP ratio",
    )
    _common(c, 5, 1)
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

    g = bs.add_parser(
        "gpu",
        help="the GPU numbers in one command inside a time budget (doctor, Triton vs torch, "
        "fwd+bwd eager/compiled, trainer tokens/s, sparse vs dense tables, MFU) -> "
        "docs/results/gpu-<card>.json; tiny shapes on the CPU",
        description="Sections, in order while the time budget lasts: doctor (the kernel "
        "self-checks), lookup (Triton or C against torch inside paper-l9-tngram, and one "
        "module's lookup timed), fwdbwd (forward + backward of every paper-l9-* recipe, eager, "
        "then compiled, with FLOPs, MFU and peak memory), tables (one step per "
        "optim.memory_update at V 1k/32k/128k), trainer (tokens/s of N trainer steps); "
        "paper-l9 raw / Engram / TN-gram first, the other recipes' compiled and trainer items "
        "last. An item that no longer fits the budget is skipped and named. Writes one results "
        "file; docs/GPU.md's tables are generated from it (`tngram report doc docs/GPU.md`).",
    )
    g.add_argument(
        "--out",
        metavar="PATH",
        help="results file (.json) or folder for gpu-<card>.json (default: docs/results)",
    )
    g.add_argument("--force", action="store_true", help="replace an existing results file")
    g.add_argument(
        "--budget",
        type=float_range(0.0, lo_open=True),
        default=420.0,
        metavar="S",
        help="seconds for all sections; an item that no longer fits is skipped and listed "
        "(default 420: the command with start-up stays under 8 minutes on one H100/H200)",
    )
    _recipes(g, "paper-l9-* recipes (default: every recipe named paper-l9-*)")
    g.add_argument(
        "--sections",
        nargs="+",
        choices=GPU_SECTIONS,
        default=list(GPU_SECTIONS),
        help="sections to run (default: all)",
    )
    _stop_after(
        g, 3, 10, "trainer section: stop each recipe's run after N optimiser steps (default 10)"
    )
    _data_dir(g, "dataset folder for the trainer section (default: the default corpus)")
    _reps(g, None, "timed reps (default: 10 on a GPU, 2 on the CPU)")
    g.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    g.add_argument(
        "--profile",
        action="store_true",
        help="fwdbwd section: after each item's timing, profile 3 more steps (torch.profiler) "
        "and record the step's time by kernel and kernel category (no extra compile)",
    )
    add_set_argument(
        g,
        help="trainer section: a setting for every recipe's run, as `tngram train --set` "
        "(repeatable; e.g. optim.memory_update=sparse)",
    )
    g.add_argument(
        "--triton-backward",
        choices=TRITON_BACKWARDS,
        default="fused",
        help="how the TN-gram Triton lookup's backward runs in every section but kernels: "
        "fused (one kernel) or split (its absorption and scale gradients in a second kernel); "
        "default fused",
    )
    g.add_argument(
        "--triton-backward-warps",
        type=int_range(0, 32),
        default=0,
        metavar="N",
        help="num_warps of that backward in every section but kernels: 0 = the forward's, or a "
        "power of two up to 32 (default 0)",
    )
    g.set_defaults(func=_gpu)
