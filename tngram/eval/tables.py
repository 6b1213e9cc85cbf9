"""Downstream-task tables in the layout of the paper's Tables 2-3: methods as rows, tasks as
columns.

`core_tables(results)` takes {method name: CORE result} (the dicts `tngram eval core` writes to
RUN_DIR/eval/core*.json) and returns (markdown, csv). Markdown cells are per-task accuracy in
percent (1 decimal) and CORE (mean centred accuracy) x 100 (2 decimals), best value of each column
in bold (every tie bold), "-" where a method lacks a task. The CSV holds the unrounded fractions.
Task columns follow nanochat's CORE order; unknown labels follow in first-seen order.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from tngram.common import TngramError
from tngram.eval.tasks import CORE_TASKS


def _columns(results: dict[str, dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for res in results.values():
        for label in res.get("tasks", {}):
            if label not in seen:
                seen.append(label)
    order = [t.label for t in CORE_TASKS if t.label in seen]
    return order + [label for label in seen if label not in order]


def _best(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def core_tables(results: dict[str, dict[str, Any]], metric: str = "accuracy") -> tuple[str, str]:
    """(markdown, csv) for {method: evaluate_core result}; metric: "accuracy" or "centered"."""
    if not results:
        raise TngramError("no results to tabulate")
    if metric not in ("accuracy", "centered"):
        raise TngramError(f"metric must be 'accuracy' or 'centered', got {metric!r}")
    for name, res in results.items():
        if "core" not in res or "tasks" not in res:
            raise TngramError(f"result of {name!r} has no 'core'/'tasks' (not a CORE result file?)")
    cols = _columns(results)
    methods = list(results)
    grid: dict[str, list[float | None]] = {
        m: [
            float(results[m]["core"]),
            *(
                float(results[m]["tasks"][c][metric]) if c in results[m]["tasks"] else None
                for c in cols
            ),
        ]
        for m in methods
    }
    best = [_best([grid[m][j] for m in methods]) for j in range(len(cols) + 1)]

    def cell(v: float | None, j: int) -> str:
        if v is None:
            return "-"
        s = f"{100 * v:.2f}" if j == 0 else f"{100 * v:.1f}"
        # compare at display precision so visually tied cells are all bold
        b = best[j]
        return (
            f"**{s}**"
            if b is not None and s == (f"{100 * b:.2f}" if j == 0 else f"{100 * b:.1f}")
            else s
        )

    header = ["Method", "CORE"] + cols
    md = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + [":---:"] * (len(cols) + 1)) + "|",
    ]
    for m in methods:
        md.append("| " + " | ".join([m] + [cell(v, j) for j, v in enumerate(grid[m])]) + " |")
    ns = {
        c: sorted({results[m]["tasks"][c]["n"] for m in methods if c in results[m]["tasks"]})
        for c in cols
    }
    unit = "accuracy (%)" if metric == "accuracy" else "centred accuracy (x100)"
    note = (
        f"Tasks: {unit}; CORE: mean centred accuracy over each method's tasks (x100). "
        f"Best per column in bold."
    )
    uneven = [c for c in cols if len(ns[c]) > 1]
    if uneven:
        note += " Item counts differ between methods for: " + ", ".join(uneven) + "."
    md += ["", note]

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "core"] + cols)
    for m in methods:
        w.writerow([m] + ["" if v is None else f"{v:.6f}" for v in grid[m]])
    return "\n".join(md) + "\n", buf.getvalue()
