"""`python -m research bench gpu`: its arguments and the command (research.bench.gpu does the
measuring).

Kept apart from research/cli/bench.py, which registers it (`add_gpu_command`), for the length of
that file; the flags several bench subcommands share come from research/cli/bench_args.py.
"""

from __future__ import annotations

import argparse
from typing import Any

from tngram.cli.argtypes import float_range, int_range
from research.cli.bench_args import (
    add_data_dir,
    add_recipes,
    add_reps,
    add_stop_after,
    results_file_fields,
)
from research.bench.gpu_sections import SECTIONS
from tngram.cli.common import add_set_argument

GPU_SECTIONS = SECTIONS  # the bench's sections, in their order
MAX_TABLE_VOCAB = 262_144  # twice the largest default: a table step at 131k builds 2.8 B params
# tngram.kernels.policy.TRITON_BACKWARDS (the same test checks it)
TRITON_BACKWARDS = ("fused", "split", "sorted")


def _gpu_out(out: str | None, slug: str) -> Any:
    """The results file: --out FILE.json, or gpu-<card>.json in --out DIR (default: the current
    folder)."""
    from pathlib import Path

    from tngram.common import TngramError

    p = Path(out) if out else Path(".")
    path = p if p.suffix == ".json" else p / f"gpu-{slug}.json"
    if not path.parent.is_dir():
        raise TngramError(f"--out: folder {path.parent} does not exist")
    return path


def _gpu(args: argparse.Namespace) -> int:
    """Validate everything before any measurement (exit 2 on bad input), then run and write."""
    import torch

    from research.bench import gpu
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
        vocabs=tuple(args.vocabs) if args.vocabs else None,
        policy=policy,
        doctor=diagnose,
        say=lambda line: print(line, flush=True),
        save=save,
    )
    save(res)
    print(gpu.report(res))
    print(f"wrote {path}")
    return 0


def add_gpu_command(bs: Any) -> None:
    """The `gpu` subcommand under `python -m research bench` (bs: its subparsers)."""
    g = bs.add_parser(
        "gpu",
        help="the GPU numbers in one command inside a time budget (doctor, Triton vs torch, "
        "fwd+bwd eager/compiled, trainer tokens/s, sparse vs dense tables, MFU) -> "
        "gpu-<card>.json; tiny shapes on the CPU",
        description="Sections, in order while the time budget lasts: doctor (the kernel "
        "self-checks), lookup (Triton or C against torch inside paper-l9-tngram, and one "
        "module's lookup timed), kernels (the Triton lookup's backward variants of each TN-gram "
        "recipe timed against each other and against torch.compile's code for the same "
        "stage), attention (paper-l9's attention alone per SDPA "
        "backend, and torch's pick), optim (the optimiser step alone: Adam, and Muon per "
        "matrix against stacked by shape), fwdbwd (forward + backward of every paper-l9-* "
        "recipe, eager, then compiled, with FLOPs, MFU and peak memory), tables (one step per "
        "optim.memory_update at V 1k/32k/128k), trainer (tokens/s of N trainer steps); "
        "paper-l9 raw / Engram / TN-gram first, the other recipes' compiled and trainer items "
        "last. An item that no longer fits the budget is skipped and named (on the CPU the "
        "estimate is the longest item run so far). Without CUDA every item runs at tiny shapes, "
        "which checks the command and measures no GPU. Writes one results file (copied into "
        "research/results/, the tables of docs/GPU.md and research/GPU.md are generated from it: "
        "`python -m research report doc FILE`).",
    )
    g.add_argument(
        "--out",
        metavar="PATH",
        help="results file (.json) or folder for gpu-<card>.json (default: the current folder)",
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
    add_recipes(g, "paper-l9-* recipes (default: every recipe named paper-l9-*)")
    g.add_argument(
        "--sections",
        nargs="+",
        choices=GPU_SECTIONS,
        default=list(GPU_SECTIONS),
        help="sections to run (default: all)",
    )
    add_stop_after(
        g, 3, 10, "trainer section: stop each recipe's run after N optimiser steps (default 10)"
    )
    add_data_dir(g, "dataset folder for the trainer section (default: the default corpus)")
    add_reps(g, None, "timed reps (default: 10 on a GPU, 2 on the CPU)")
    g.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    g.add_argument(
        "--profile",
        action="store_true",
        help="fwdbwd section: after each item's timing, profile 3 more steps (torch.profiler) "
        "and record the step's time by kernel and kernel category (no extra compile)",
    )
    g.add_argument(
        "--vocabs",
        nargs="+",
        type=int_range(64, MAX_TABLE_VOCAB),
        metavar="V",
        help="tables section: the vocabularies to step at (default: 1024 32768 131072 on a "
        "GPU, 128 256 512 on the CPU)",
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
        "fused (one kernel), split (its absorption and scale gradients in a second kernel) or "
        "sorted (the factor rows' gradients stored, then summed per row by a sort, not added "
        "by atomics); default fused",
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
