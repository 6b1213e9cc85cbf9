"""`python -m research experiment table-update`: its runs are the pareto map's runs plus twins that differ only in
optim.memory_update, and its paired table is the paired statistics of those differences."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from research.experiments import table_update as tu
from research.experiments import pareto as P
from research.experiments.pareto import TUNED_DEFAULT, specs_for


@pytest.fixture
def specs(monkeypatch):
    # configs only: the corpus folder is named, never read (no corpus is built in the suite)
    monkeypatch.setattr(P, "corpus_data", lambda corpus: (f"/data/{corpus}", 1024))
    return tu.specs(["default"], "mini", 2, 3, dict(TUNED_DEFAULT))


def test_dense_runs_are_the_pareto_runs_and_twins_change_only_the_update(specs):
    factors = {**TUNED_DEFAULT, "oe": 2.0, "longcat": 2.0}
    pareto = {s.label: s for s in specs_for(["default"], "mini", 2, 3, factors)}
    # seeds x memories x (dense, sparse, rowwise, sparse+catchup, rowwise+catchup)
    assert len(specs) == 2 * 2 * 5
    for s in specs:
        base = s.label.replace("-catchup", "").replace("-sparse", "").replace("-rowwise", "")
        assert base in pareto                # the dense twin is a pareto point, same folder name
        want = pareto[base].config.to_dict()
        got = s.config.to_dict()
        if s.tags["update"] == "dense":
            assert got == want
        else:
            assert got["optim"].pop("memory_update") == s.tags["update"].split("+")[0]
            assert got["optim"].pop("memory_catchup", False) == s.tags["update"].endswith("+catchup")
            assert got == want
    assert {(s.tags["family"], s.tags["size"]) for s in specs} == {("engram", 3800), ("tngram", 352)}


def _row(corpus, fam, update, seed, loss):
    return {"corpus": corpus, "family": fam, "update": update, "seed_index": seed, "val_loss": loss}


def test_paired_rows_are_the_paired_differences_with_a_t_interval():
    dense = [3.30, 3.32, 3.28]
    diffs = [0.004, -0.001, 0.003]
    rows = [_row("default", "engram", "dense", i, d) for i, d in enumerate(dense)]
    rows += [_row("default", "engram", "sparse", i, d + e) for i, (d, e) in enumerate(zip(dense, diffs))]
    rows += [_row("default", "engram", "rowwise", 0, 3.31)]          # one pair only
    rows += [_row("default", "tngram", "sparse", 0, 3.4)]            # no dense twin: no row
    table = tu.paired_rows(rows)
    assert [r[:4] for r in table] == [["default", "engram", "sparse", 3], ["default", "engram", "rowwise", 1]]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    half = 4.302652729749464 * sd / math.sqrt(3)       # t_{0.975, 2} (tables of Student's t)
    sparse = table[0]
    assert sparse[4] == dense
    assert sparse[5] == pytest.approx(mean, abs=1e-12)
    assert sparse[6] == pytest.approx([mean - half, mean + half], abs=1e-9)
    assert sparse[7] == ("yes" if -0.005 <= mean - half and mean + half <= 0.005 else "no")
    assert table[1][5] == pytest.approx(3.31 - 3.30) and table[1][6] is None and table[1][7] is None


def test_cli_refuses_data_and_core_max(tmp_path):
    for extra in (["--data", str(tmp_path)], ["--core-max", "3"]):
        p = subprocess.run([sys.executable, "-m", "research", "experiment", "table-update", "--out",
                            str(tmp_path / "o"), "--report-only", *extra], capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert "table-update" in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "o").exists()
