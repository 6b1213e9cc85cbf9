"""`python -m research report readme|doc`: the generated tables of the docs, rendered from the
results files in research/results/; `report tables RUN_DIR...` (paper Tables 2-3 layout) and
`report compare DIR...` (a compare folder's report.md again, or paired significance per corpus)."""

from __future__ import annotations

import os
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


def _cmd_tables(args: Any) -> int:
    from tngram.common import TngramError, atomic_write_text
    from tngram.eval.tables import core_tables

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
    from tngram.report.compare import significance_table

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

    path = dir / "results.json"
    if not path.exists():
        raise MissingFileError(f"{path} not found: is {dir} a `tngram compare` folder?")
    from tngram.readback import get, read_results_file

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


# the fields of a results row the compare report reads
COMPARE_ROW = ("method", "seed", "run_dir", "train_loss", "val_loss", "val_bpb", "tokens_per_s")


def rows_from_folder(folder: Path) -> list[dict[str, Any]]:
    """Rows (method, seed, losses, run_dir) of a compare-style folder: every finished run in
    folder/runs/<method>-s<i>/ (summary.json + config.json), so a half-finished `tngram compare`
    or one with seeds added later is reported in full; results.json only when runs/ is gone."""
    from tngram.readback import get, load_json, read_results_file, read_summary_file

    path = folder / "results.json"
    if not (folder / "runs").is_dir() and path.exists():
        return read_results_file(path, require=COMPARE_ROW)["rows"]
    rows = []
    for run in sorted((folder / "runs").glob("*-s*")):
        summary, config = run / "summary.json", run / "config.json"
        if not (summary.exists() and config.exists()):
            continue
        s, c = read_summary_file(summary, run), load_json(config, run)
        for k in COMPARE_ROW:
            if k not in ("method", "seed", "run_dir"):
                get(s, k, "any-number?", str(summary))  # present (NaN: a diverged run)
        seed = get(get(c, "run", "dict", str(config)), "seed", "int", f"{config}: run", lo=0)
        rows.append({**s, "method": run.name.rsplit("-s", 1)[0], "seed": seed, "run_dir": str(run)})
    return rows


def read_core(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's CORE result written by `tngram eval core`: eval/core.json, else the newest
    eval/core-max*.json; None when the run has not been evaluated."""
    from tngram.readback import read_core_file
    from tngram.safefs import check_chain, real_dir

    ev = Path(run_dir) / "eval"
    check_chain(run_dir, ev, include_self=True)
    if not real_dir(ev):
        return None
    full = ev / "core.json"
    if os.path.lexists(full):
        return read_core_file(full, run_dir)
    partial = sorted(ev.glob("core-max*.json"), key=lambda p: p.lstat().st_mtime)
    return read_core_file(partial[-1], run_dir) if partial else None


def run_name(run_dir: str | Path) -> str:
    from tngram.readback import load_json

    cfg = Path(run_dir) / "config.json"
    if os.path.lexists(cfg):
        name = load_json(cfg, run_dir).get("name", Path(run_dir).name)
        return name if isinstance(name, str) else Path(run_dir).name
    return Path(run_dir).name
