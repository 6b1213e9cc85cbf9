"""`python -m research report tables` and `report compare` read only run folders."""

from __future__ import annotations

import json

import pytest

from research.cli import main
from research.cli.report import read_core
from tngram.common import TngramError


def fake_run(root, name, core, tasks):
    d = root / name
    (d / "eval").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"name": name}))
    (d / "eval" / "core-max10.json").write_text(json.dumps(
        {"core": core, "tasks": {t: {"accuracy": a, "centered": a - 0.25, "n": 10} for t, a in tasks.items()}}))
    return d


def test_tables_from_run_folders(tmp_path):
    a = fake_run(tmp_path, "mini-raw", 0.01, {"piqa": 0.55, "copa": 0.50})
    b = fake_run(tmp_path, "mini-tngram", 0.03, {"piqa": 0.60, "copa": 0.48})
    assert main(["report", "tables", str(a), str(b), "--out", str(tmp_path / "t")]) == 0
    md = (tmp_path / "t" / "core_tables.md").read_text()
    # the best value of each column is bold: TN-gram on PIQA (60.0 > 55.0), raw on COPA
    assert "**60.0**" in md and "**50.0**" in md and "| mini-tngram" in md
    assert "piqa" in (tmp_path / "t" / "core_tables.csv").read_text().lower()


def test_tables_needs_an_evaluated_run(tmp_path):
    (tmp_path / "r").mkdir()
    with pytest.raises(TngramError, match="tngram eval core"):
        from research.cli.report import _cmd_tables
        import argparse
        _cmd_tables(argparse.Namespace(run_dirs=[str(tmp_path / "r")], metric="accuracy", out=tmp_path))


def test_read_core_prefers_the_full_evaluation(tmp_path):
    d = fake_run(tmp_path, "x", 0.02, {"piqa": 0.5})
    assert read_core(d)["core"] == 0.02
    (d / "eval" / "core.json").write_text(json.dumps({"core": 0.05, "tasks": {}}))
    assert read_core(d)["core"] == 0.05


def test_compare_table_pairs_tngram_and_engram_by_seed():
    """Per-seed differences 3.30 - 3.35 = -0.05 and 3.41 - 3.40 = +0.01 (seed order), mean -0.02,
    std sqrt(((-0.03)^2 + 0.03^2) / 1) = 0.0424; a seed without Engram is not paired."""
    from tngram.report.compare import compare_table, paired_metric
    rows = [{"method": m, "seed": s, "val_loss": v, "train_loss": v, "val_bpb": v / 2, "delta_params": 1,
             "tokens_per_s": 1.0}
            for m, s, v in [("raw", 2, 3.9), ("engram", 2, 3.40), ("tngram", 2, 3.41),
                            ("raw", 1, 3.8), ("engram", 1, 3.35), ("tngram", 1, 3.30), ("tngram", 3, 1.0)]]
    assert paired_metric(rows, "tngram", "engram") == pytest.approx([-0.05, 0.01])
    table = compare_table({"rows": rows, "preset": "cpu"})
    assert "paired by seed" in table and "-0.0500, +0.0100 (mean -0.0200 ± 0.0424" in table


def test_report_compare_finds_runs_inside_a_moved_folder(tmp_path, monkeypatch):
    """results.json records run_dir relative to where `tngram compare` ran; `report compare DIR`
    must read DIR/runs/NAME (here the recorded paths do not exist from the test's cwd) and pick
    up each run's CORE."""
    cmp_dir = tmp_path / "moved" / "compare-cpu"
    rows = []
    for i, (m, v) in enumerate([("raw", 3.7), ("engram", 3.36), ("tngram", 3.35)]):
        d = fake_run(cmp_dir / "runs", f"{m}-s0", 0.01 * (i + 1), {"t": 0.3})
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": v + 0.1, "val_loss": v}) + "\n")
        rows.append({"method": m, "seed": 1, "delta_params": i, "train_loss": v, "val_loss": v,
                     "val_bpb": v / 2, "core": None, "tokens_per_s": 1.0, "wall_s": 1.0,
                     "run_dir": f"runs/compare-cpu/runs/{m}-s0"})
    (cmp_dir / "results.json").write_text(json.dumps({"preset": "cpu", "data": "x", "rows": rows}))
    monkeypatch.chdir(tmp_path)
    assert main(["report", "compare", str(cmp_dir)]) == 0
    res = json.loads((cmp_dir / "results.json").read_text())
    assert [r["core"] for r in res["rows"]] == [0.01, 0.02, 0.03]
    assert res["rows"][0]["run_dir"] == "runs/compare-cpu/runs/raw-s0"     # the record is kept
    assert "| CORE |" in (cmp_dir / "report.md").read_text() and (cmp_dir / "loss_curves.png").exists()
