"""CLI: `tngram report tables RUN_DIR...` (paper Tables 2-3 layout), `tngram report compare DIR`
and the generated blocks of the docs (`report readme`, `report doc`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_commands(sub: Any) -> None:
    p = sub.add_parser("report", help="tables and plots from run folders")
    rs = p.add_subparsers(dest="report_command", metavar="SUBCOMMAND")
    rs.required = True
    t = rs.add_parser(
        "tables",
        help="downstream-task tables (methods x tasks, best in bold) from runs "
        "evaluated with `tngram eval core`",
    )
    t.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folders evaluated with `tngram eval core`",
    )
    t.add_argument(
        "--metric",
        choices=["accuracy", "centered"],
        default="accuracy",
        help="accuracy, or centered (0 = random baseline, 1 = perfect)",
    )
    t.add_argument("--out", type=Path, default=Path("."), help="folder for core_tables.md/.csv")
    t.set_defaults(func=_cmd_tables)
    c = rs.add_parser(
        "compare",
        help="rebuild report.md of a `tngram compare` folder (adds CORE when "
        "the runs have been evaluated); with several folders (one per corpus), "
        "paired significance per corpus and pooled",
    )
    c.add_argument(
        "dir", type=Path, nargs="+", metavar="DIR", help="the --out folder(s) of `tngram compare`"
    )
    c.add_argument(
        "--metric",
        choices=["val_loss", "val_bpb", "train_loss"],
        default="val_loss",
        help="metric of the significance table (several folders)",
    )
    c.set_defaults(func=_cmd_compare)
    r = rs.add_parser(
        "readme",
        help="regenerate the demo's results table (docs/RESULTS.md, or --doc FILE) from a "
        "`tngram compare` folder",
        description="Snapshot a `tngram compare` folder (the runs/compare-cpu of `make demo`) "
        "into docs/results/NAME.json and regenerate the Markdown block that cites it "
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
        default=Path("docs/RESULTS.md"),
        metavar="FILE",
        help="the Markdown file to update or check",
    )
    r.add_argument(
        "--name",
        default="demo-compare-cpu",
        help="the block to regenerate; its snapshot is docs/results/NAME.json",
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
        "their results files in docs/results/",
        description="Every block between <!-- BEGIN generated: NAME --> and <!-- END "
        "generated: NAME --> is rendered from docs/results/FILE.json (FILE = NAME up to the "
        "first ':'; NAME = FILE:VIEW picks a view of one results file). Without --check the "
        "file is rewritten; with --check it is only compared (exit 1 when a block differs).",
    )
    d.add_argument(
        "docs", type=Path, nargs="+", metavar="FILE", help="Markdown file(s), e.g. docs/RESULTS.md"
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
    from tngram.report.docblocks import block_names, check_doc, regenerate_doc

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
                    f"`tngram report doc {doc}` to regenerate it",
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
    from tngram.report.readme import render_block, replace_block, snapshot, snapshot_path

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
    new_text = replace_block(text, args.name, render_block(snap, f"docs/results/{args.name}.json"))
    atomic_write_json(snap_path, snap)
    atomic_write_text(args.readme, new_text)
    print(f"wrote {snap_path} and the {args.name!r} block of {args.readme}")
    return 0


def _cmd_tables(args: Any) -> int:
    from tngram.common import TngramError, atomic_write_text
    from tngram.eval.tables import core_tables
    from tngram.report.runs import read_core, run_name

    results = {}
    for d in args.run_dirs:
        core = read_core(d)
        if core is None:
            raise TngramError(f"{d} has no eval/core*.json: run `tngram eval core {d}` first")
        results[run_name(d)] = core
    md, csv_text = core_tables(results, metric=args.metric)
    atomic_write_text(args.out / "core_tables.md", md + "\n")
    atomic_write_text(args.out / "core_tables.csv", csv_text)
    print(md)
    print(f"\nwritten: {args.out / 'core_tables.md'}, {args.out / 'core_tables.csv'}")
    return 0


def _cmd_compare(args: Any) -> int:
    from tngram.common import MissingFileError, TngramError
    from tngram.report.compare import rows_from_folder, significance_table

    if len(args.dir) == 1 and (
        (args.dir[0] / "results.json").exists() or not (args.dir[0] / "runs").is_dir()
    ):
        return _compare_one(args.dir[0])
    by_corpus = {}
    for d in args.dir:
        if not (d / "runs").is_dir():
            raise MissingFileError(f"{d} has no runs/ folder: is it a `tngram compare` folder?")
        rows = rows_from_folder(d)
        if not rows:
            raise TngramError(f"{d}: no finished runs yet (no runs/*/summary.json)")
        by_corpus[d.name] = rows
    print(significance_table(by_corpus, metric=args.metric))
    return 0


def _compare_one(dir: Path) -> int:
    from tngram.common import MissingFileError, atomic_write_json
    from tngram.report.compare import write_compare_report
    from tngram.report.runs import read_core

    path = dir / "results.json"
    if not path.exists():
        raise MissingFileError(f"{path} not found: is {dir} a `tngram compare` folder?")
    from tngram.readback import get, read_results_file
    from tngram.report.compare import COMPARE_ROW

    results = read_results_file(path, require=COMPARE_ROW)
    get(results, "preset", "str", str(path))
    get(results, "data", "str", str(path), default=None)
    # run_dir was recorded relative to the cwd of `tngram compare`; the run folder itself is
    # DIR/runs/NAME, which still holds when DIR is moved or read from another directory
    local = {id(r): dir / "runs" / Path(r.get("run_dir", "")).name for r in results["rows"]}
    local = {k: v for k, v in local.items() if v.is_dir()}
    for r in results["rows"]:
        rd = local.get(id(r), r.get("run_dir"))
        core = read_core(rd) if rd else None
        if core is not None:
            r["core"] = core["core"]
    atomic_write_json(path, results)
    shown = {
        **results,
        "rows": [
            {**r, "run_dir": str(local[id(r)])} if id(r) in local else r for r in results["rows"]
        ],
    }
    print(write_compare_report(dir, shown)["table"])
    return 0
