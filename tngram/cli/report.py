"""CLI: `tngram report tables RUN_DIR...` (paper Tables 2-3 layout) and `tngram report compare
DIR`."""

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
