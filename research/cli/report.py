"""`python -m research report readme|doc`: the generated tables of the docs, rendered from the
results files in research/results/."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_commands(sub: Any) -> None:
    p = sub.add_parser("report", help="the generated tables of the docs, from research/results/")
    rs = p.add_subparsers(dest="report_command", metavar="SUBCOMMAND")
    rs.required = True
    r = rs.add_parser(
        "readme",
        help="regenerate the demo's results table (research/RESULTS.md, or --doc FILE) from a "
        "`tngram compare` folder",
        description="Snapshot a `tngram compare` folder (the runs/compare-cpu of `make demo`) "
        "into research/results/NAME.json and regenerate the Markdown block that cites it "
        "(between <!-- BEGIN generated: NAME --> and <!-- END generated: NAME -->). With "
        "--check, only verify that every generated block of the file equals its snapshot.",
    )
    r.add_argument(
        "dir",
        type=Path,
        nargs="?",
        default=None,
        metavar="DIR",
        help="the --out folder of `tngram compare` (not needed with --check)",
    )
    r.add_argument(
        "--readme",
        "--doc",
        dest="readme",
        type=Path,
        default=Path("research/RESULTS.md"),
        metavar="FILE",
        help="the Markdown file to update or check",
    )
    r.add_argument(
        "--name",
        default="demo-compare-cpu",
        help="the block to regenerate; its snapshot is research/results/NAME.json",
    )
    r.add_argument(
        "--note", default=None, help="a sentence shown under the table (e.g. the machine's load)"
    )
    r.add_argument(
        "--check", action="store_true", help="compare only; exit 1 when a block disagrees"
    )
    r.set_defaults(func=_cmd_readme)
    d = rs.add_parser(
        "doc",
        help="regenerate (or --check) the generated tables of a Markdown file from "
        "their results files in research/results/",
        description="Every block between <!-- BEGIN generated: NAME --> and <!-- END "
        "generated: NAME --> is rendered from research/results/FILE.json (FILE = NAME up to the "
        "first ':'; NAME = FILE:VIEW picks a view of one results file). Without --check the "
        "file is rewritten; with --check it is only compared (exit 1 when a block differs).",
    )
    d.add_argument(
        "docs",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="Markdown file(s), e.g. research/RESULTS.md",
    )
    d.add_argument(
        "--name",
        action="append",
        default=None,
        metavar="NAME",
        help="only this block (repeatable; default: every block)",
    )
    d.add_argument(
        "--check", action="store_true", help="compare only; exit 1 when a block disagrees"
    )
    d.set_defaults(func=_cmd_doc)


def _cmd_doc(args: Any) -> int:
    import sys

    from tngram.common import MissingFileError, atomic_write_text
    from research.report.docblocks import block_names, check_doc, regenerate_doc

    for doc in args.docs:
        if not doc.is_file():
            raise MissingFileError(f"{doc}: file not found")
    bad = 0
    for doc in args.docs:
        if args.check:
            differ = [n for n in check_doc(doc) if not args.name or n in args.name]
            for n in differ:
                print(
                    f"{doc}: the generated block {n!r} differs from its results file; run "
                    f"`python -m research report doc {doc}` to regenerate it",
                    file=sys.stderr,
                )
            total = len(
                [
                    n
                    for n in block_names(doc.read_text(encoding="utf-8"), str(doc))
                    if not args.name or n in args.name
                ]
            )
            print(
                f"{doc}: checked {total} generated block(s): {total - len(differ)} match their "
                f"results files, {len(differ)} differ"
            )
            bad += len(differ)
        else:
            text, changed = regenerate_doc(doc, args.name)
            if changed:
                atomic_write_text(doc, text)
            print(
                f"{doc}: regenerated "
                f"{', '.join(changed) if changed else 'nothing (all blocks current)'}"
            )
    return 1 if bad else 0


def _cmd_readme(args: Any) -> int:

    from tngram.common import MissingFileError, TngramError, atomic_write_json, atomic_write_text
    from research.report.readme import render_block, replace_block, snapshot, snapshot_path

    if not args.readme.is_file():
        raise MissingFileError(f"{args.readme}: file not found (pass --doc PATH)")
    if args.check:
        args.docs, args.name = [args.readme], None
        return _cmd_doc(args)
    if args.dir is None:
        raise TngramError("give the `tngram compare` folder DIR (or --check)")
    text = args.readme.read_text(encoding="utf-8")
    snap = snapshot(args.dir)
    if args.note:
        snap["note"] = args.note
    snap_path = snapshot_path(args.readme, args.name)
    block = render_block(snap, f"research/results/{args.name}.json")
    new_text = replace_block(text, args.name, block)
    atomic_write_json(snap_path, snap)
    atomic_write_text(args.readme, new_text)
    print(f"wrote {snap_path} and the {args.name!r} block of {args.readme}")
    return 0
