"""The summary that opens research/RESULTS.md: one line per section, every number a cell of a committed
results file (research/results/results-summary.json says which), checked against those files here."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from tngram.common import TngramError
from research.report.docblocks import check_doc, current_block

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "research" / "RESULTS.md"
SUMMARY = json.loads((ROOT / "research/results/results-summary.json").read_text())
NO_FINDING = ("Summary", "Not run here")     # sections that report no finding of their own


def _num(v: float, spec: str) -> str:
    return format(v, spec).replace("-", "\u2212")


def expected_cell(table: dict, row: int | str, column: str) -> str:
    """The cell as the section's table prints it, computed here from the raw value (an
    independent re-implementation of the few formats the summary cites)."""
    heads = [c["header"] if isinstance(c, dict) else c for c in table["columns"]]
    col = table["columns"][heads.index(column)]
    fmt = col.get("fmt", "") if isinstance(col, dict) else ""
    rows = table["rows"]
    r = rows[row] if isinstance(row, int) else next(x for x in rows if str(x[0]) == row)
    v = r[heads.index(column)]
    bold = isinstance(v, dict) and v.get("bold")
    if isinstance(v, dict):
        v = v["value"]
    if isinstance(v, str):
        text = v
    elif fmt.startswith("mean_std:"):
        spec = fmt.split(":", 1)[1]
        text = _num(statistics.mean(v), spec) if len(v) == 1 else \
            f"{_num(statistics.mean(v), spec)} ± {_num(statistics.stdev(v), spec.lstrip('+'))}"
    elif fmt.startswith("list:"):
        text = ", ".join(_num(x, fmt.split(":", 1)[1]) for x in v)
    elif fmt == "params":
        text = f"{v / 1e6:.2f}M"
    else:
        text = _num(v, fmt)
    return f"**{text}**" if bold else text


def test_every_number_is_its_results_files_cell():
    block = current_block(RESULTS.read_text(encoding="utf-8"), "results-summary")
    for f in SUMMARY["findings"]:
        values = {}
        for slot, ref in f["cells"].items():
            table = json.loads((ROOT / "research/results" / f"{ref['file']}.json").read_text())
            values[slot] = expected_cell(table, ref["row"], ref["column"])
        line = f["finding"].format(**values)
        assert f"| {f['section']} | {line} |" in block, line


def test_a_changed_results_file_makes_the_summary_disagree(tmp_path):
    docs = tmp_path / "research"
    shutil.copytree(ROOT / "research" / "results", tmp_path / "research" / "results")
    shutil.copy(RESULTS, docs / "RESULTS.md")
    assert check_doc(docs / "RESULTS.md") == []
    f = tmp_path / "research" / "results" / "default-paired.json"
    snap = json.loads(f.read_text())
    snap["rows"][0][3] += 0.001                      # the mean the summary's first line quotes
    f.write_text(json.dumps(snap))
    assert sorted(check_doc(docs / "RESULTS.md")) == ["default-paired", "results-summary"]


def test_every_section_has_a_summary_line_and_every_line_a_section():
    heads = re.findall(r"^## (.+)$", RESULTS.read_text(encoding="utf-8"), flags=re.M)
    sections = [f["section"] for f in SUMMARY["findings"]]
    for s in sections:
        assert any(h.startswith(s) for h in heads), f"summary line for a missing section: {s!r}"
    missing = [h for h in heads if not h.startswith(NO_FINDING) and not any(h.startswith(s) for s in sections)]
    assert not missing, (f"RESULTS.md sections without a line in the summary: {missing} "
                         "(add a finding to research/results/results-summary.json, then `python -m research report doc "
                         "research/RESULTS.md`)")


def test_a_bad_pointer_is_one_line_naming_file_and_column(tmp_path):
    from research.report.summary import resolve
    (tmp_path / "t.json").write_text(json.dumps({"kind": "table", "columns": [{"header": "a"}], "rows": [[1.0]]}))
    bad = {"findings": [{"section": "S", "finding": "{x}", "cells": {"x": {"file": "t", "row": 0, "column": "b"}}}]}
    with pytest.raises(TngramError, match=r"research/results/t.json .*no column 'b'; columns: \['a'\]"):
        resolve(bad, tmp_path)
    ok = {"findings": [{"section": "S", "finding": "x = {x}", "cells": {"x": {"file": "t", "row": 0, "column": "a"}}}]}
    assert resolve(ok, tmp_path)["resolved"][0]["text"] == "x = 1.0"
