"""The one-screen summary that opens research/RESULTS.md: one line per finding, its numbers read
from
the committed results files (research/results/*.json) of the section that reports the finding.

A results file of kind "summary" holds words and pointers only, never a number:

    {"kind": "summary", "command": ..., "commit": ..., "machine": ...,
     "findings": [{"section": "How sure are we?",              # the RESULTS.md heading it sums up
                   "finding": "TN-gram - Engram {mean} nats, 95% CI {ci}",
                   "cells": {"mean": {"file": "default-paired", "row": 0, "column": "mean"},
                             "ci": {"file": "default-paired", "row": 0, "column": "95% CI"}}}]}

`resolve(snap, results_dir)` fills each {slot} with the cell of that file's table (row: its
index, or the text of its first cell; column: its header), rendered with the column's own format,
so a summary line shows exactly what the section's table shows and cannot drift from it: a changed
results file changes the summary, and `python -m research report doc --check` fails until it is
regenerated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, TngramError
from research.report.markdown import md_row, read_results, render_cell


def _row(table: dict[str, Any], key: int | str, where: str) -> list[Any]:
    rows = table.get("rows") or []
    if isinstance(key, int):
        if not 0 <= key < len(rows):
            raise TngramError(f"{where}: row {key} out of range (the table has {len(rows)} rows)")
        return rows[key]
    for r in rows:
        if r and render_cell(r[0]) == key:
            return r
    raise TngramError(
        f"{where}: no row whose first cell is {key!r}; rows: "
        f"{[render_cell(r[0]) for r in rows if r]}"
    )


def cell_text(table: dict[str, Any], row: int | str, column: str, where: str) -> str:
    """The rendered cell (row, column) of a "table" results file, as its own table shows it."""
    cols = table.get("columns") or []
    heads = [c["header"] if isinstance(c, dict) else str(c) for c in cols]
    if column not in heads:
        raise TngramError(f"{where}: no column {column!r}; columns: {heads}")
    i = heads.index(column)
    fmt = cols[i].get("fmt", "") if isinstance(cols[i], dict) else ""
    return render_cell(_row(table, row, where)[i], fmt)


def resolve(snap: dict[str, Any], results_dir: Path) -> dict[str, Any]:
    """`snap` with each finding's text filled in from the results files it points to (and the
    files it read listed under "sources")."""
    tables: dict[str, dict[str, Any]] = {}
    lines = []
    for n, f in enumerate(snap.get("findings") or []):
        values = {}
        for slot, ref in (f.get("cells") or {}).items():
            name = ref["file"]
            if name not in tables:
                path = results_dir / f"{name}.json"
                if not path.is_file():
                    raise MissingFileError(
                        f"summary finding {n + 1} cites {path}, which is missing"
                    )
                tables[name] = read_results(path)
            values[slot] = cell_text(
                tables[name],
                ref["row"],
                ref["column"],
                f"research/results/{name}.json (summary finding {n + 1}, {{{slot}}})",
            )
        try:
            text = f["finding"].format(**values)
        except KeyError as e:
            raise TngramError(f"summary finding {n + 1}: slot {e} has no cell") from None
        lines.append(
            {
                "section": f["section"],
                "text": text,
                "files": sorted({ref["file"] for ref in (f.get("cells") or {}).values()}),
            }
        )
    return {**snap, "resolved": lines}


def render_summary(snap: dict[str, Any]) -> str:
    """The summary table of a resolved "summary" results file."""
    if "resolved" not in snap:
        raise TngramError(
            "a 'summary' results file must be resolved against research/results first"
        )
    out = ["| question (section below) | finding | numbers from |", "|---|---|---|"]
    for line in snap["resolved"]:
        files = ", ".join(f"`{name}.json`" for name in line["files"])
        out.append(md_row([line["section"], line["text"], files]))
    return "\n".join(out)
