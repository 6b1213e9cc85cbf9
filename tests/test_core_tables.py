"""Paper-style CORE tables (methods x tasks, best in bold) from result dicts."""

from __future__ import annotations

import csv
import io

import pytest

from tngram.common import TngramError
from tngram.eval.tables import core_tables


def _res(core: float, **tasks: tuple[float, float, int]) -> dict:
    return {"core": core, "tasks": {k: {"accuracy": a, "centered": c, "n": n} for k, (a, c, n) in tasks.items()}}


RESULTS = {
    # piqa centred = (acc - 0.5)/0.5; arc_easy centred = (acc - 0.25)/0.75; lambada centred = acc
    "GPT": _res(0.1, piqa=(0.60, 0.20, 100), arc_easy=(0.40, 0.20, 100), my_task=(0.5, 0.5, 10)),
    "TN-gram": _res(0.2, piqa=(0.62, 0.24, 100), arc_easy=(0.40, 0.20, 100), lambada_openai=(0.3, 0.3, 50)),
}


def test_markdown_layout_and_bold() -> None:
    md, _ = core_tables(RESULTS)
    lines = md.splitlines()
    # columns: CORE, then tasks in nanochat order (arc_easy #4, piqa #8, lambada #10), unknown ones last
    assert lines[0] == "| Method | CORE | arc_easy | piqa | lambada_openai | my_task |"
    # CORE x100: 10.00 vs 20.00 -> TN-gram bold; arc_easy tie 40.0 -> both bold; piqa 62.0 > 60.0;
    # missing tasks "-"; a column with one value has that value bold
    assert lines[2] == "| GPT | 10.00 | **40.0** | 60.0 | - | **50.0** |"
    assert lines[3] == "| TN-gram | **20.00** | **40.0** | **62.0** | **30.0** | - |"
    assert "Item counts differ" not in md


def test_centered_metric_and_uneven_counts() -> None:
    res = {**RESULTS, "OE": _res(0.15, piqa=(0.64, 0.28, 20))}
    md, _ = core_tables(res, metric="centered")
    # piqa centred x100: 20.0, 24.0, 28.0 -> OE bold; n differs (100 vs 20) -> noted
    assert "| OE | 15.00 | - | **28.0** | - | - |" in md
    assert "Item counts differ between methods for: piqa." in md


def test_csv_has_unrounded_values() -> None:
    _, text = core_tables(RESULTS)
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["method", "core", "arc_easy", "piqa", "lambada_openai", "my_task"]
    assert rows[1] == ["GPT", "0.100000", "0.400000", "0.600000", "", "0.500000"]


def test_bad_input() -> None:
    with pytest.raises(TngramError):
        core_tables({})
    with pytest.raises(TngramError, match="x"):
        core_tables({"x": {"tasks": {}}})
