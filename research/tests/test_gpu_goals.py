"""The GPU goal block (research.report.gpu_goals; research/GPU.md "gpu:goals"): each point from the
newest run that measured it, checked against numbers computed here from the items."""

import json
from pathlib import Path

import pytest

from tngram.common import TngramError
from research.report.docblocks import load_snapshot, render
from research.report.gpu_blocks import resolve_index
from research.report.gpu_goals import (
    big_vocab,
    goals_table,
    raw_speed,
    sparse_vs_dense,
    tngram_step,
)

ROOT = Path(__file__).resolve().parents[2]


def trainer_run(tps: dict[str, float], bpb: dict[str, float], steps: int = 40, sets=()) -> dict:
    return {
        "commit": "abc1234",
        "recipes": list(tps),
        "shapes": {"trainer_sets": list(sets), "vocabs": []},
        "sections": {
            "trainer": {
                r: {"tokens_per_s": t, "val_bpb": bpb[r], "steps": steps} for r, t in tps.items()
            }
        },
    }


def tables_run(ms: dict[str, float], vocabs: list[int]) -> dict:
    return {
        "commit": "def5678",
        "recipes": [],
        "shapes": {"trainer_sets": [], "vocabs": vocabs},
        "sections": {"tables": {k: {"median_ms": v} for k, v in ms.items()}},
    }


def test_raw_speed_at_defaults_only():
    assert raw_speed(trainer_run({"paper-l9-raw": 1.6e6}, {"paper-l9-raw": 2.0})) == (
        "1,600,000 tokens/s (1.067 of 1,500,000)",
        True,
    )
    assert raw_speed(trainer_run({"paper-l9-raw": 1.4e6}, {"paper-l9-raw": 2.0}))[1] is False
    # a run that changed a trainer setting is not the default trainer
    assert raw_speed(trainer_run({"paper-l9-raw": 1.6e6}, {"paper-l9-raw": 2.0}, sets=["x=1"])) is None


def test_tngram_step_needs_the_time_and_the_loss():
    tps = {"paper-l9-engram": 1.0e6, "paper-l9-tngram": 0.9e6, "paper-l9-tngram-hsum": 1.05e6}
    # -hsum's step: 1.0e6 / 1.05e6 = 0.952 of Engram's; its loss decides
    worse = {"paper-l9-engram": 1.60, "paper-l9-tngram": 1.55, "paper-l9-tngram-hsum": 1.61}
    text, met = tngram_step(trainer_run(tps, worse))
    assert not met and text.startswith("closest `-hsum`: 0.952× Engram's step, val bpb 1.6100")
    better = dict(worse, **{"paper-l9-tngram-hsum": 1.58})
    assert tngram_step(trainer_run(tps, better)) == (
        "meets it `-hsum`: 0.952× Engram's step, val bpb 1.5800 against 1.6000 "
        "(2 TN-gram recipes)",
        True,
    )
    # the row shown is the recipe that meets the point, not the faster one that does not:
    # -sum 1.0e6 / 1.1e6 = 0.909 with a worse loss, -hsum 0.952 with a better one
    two = dict(tps, **{"paper-l9-tngram-sum": 1.1e6})
    text, met = tngram_step(trainer_run(two, dict(better, **{"paper-l9-tngram-sum": 1.7})))
    assert met and text.startswith("meets it `-hsum`: 0.952×")
    # the slower recipe with the lower loss does not meet it: 1.0e6 / 0.9e6 = 1.111
    slow = {"paper-l9-engram": 1.0e6, "paper-l9-tngram": 0.9e6}
    assert tngram_step(trainer_run(slow, better)) == (
        "closest `paper-l9-tngram`: 1.111× Engram's step, val bpb 1.5500 against 1.6000 "
        "(1 TN-gram recipes)",
        False,
    )
    assert tngram_step(trainer_run(tps, better, steps=20)) is None  # fewer than 30 steps


def test_table_points_from_their_medians():
    V = 131072
    ms = {f"raw@{V}": 100.0, f"engram@{V}/sparse": 118.0, f"tngram@{V}/sparse": 125.0,
          f"engram@{V}/dense": 120.0, f"tngram@{V}/dense": 124.0,
          "engram@32768/sparse": 50.0, "engram@32768/dense": 60.0,
          "tngram@32768/sparse": 70.0, "tngram@32768/dense": 70.0}
    run = tables_run(ms, [1024, 32768, V])
    assert big_vocab(run) == ("Engram 1.18×, TN-gram 1.25× the raw step", False)
    assert big_vocab(tables_run(dict(ms, **{f"tngram@{V}/sparse": 119.0}), [V]))[1] is True
    text, met = sparse_vs_dense(run)
    # 125 / 124 = 1.008 at 131k: slower than dense, so not met
    assert text == ("V 32,768: Engram 0.83×, TN-gram 1.00×; V 131,072: Engram 0.98×, "
                    "TN-gram 1.01× its `dense` step") and not met
    assert sparse_vs_dense(tables_run(ms, [32768]))[1] is True
    assert sparse_vs_dense(tables_run(ms, [1024])) is None  # below 8,192: not this point


def test_each_row_is_the_newest_run_that_measured_it():
    old = trainer_run({"paper-l9-raw": 1.6e6}, {"paper-l9-raw": 2.0})
    new = dict(trainer_run({"paper-l9-raw": 1.4e6}, {"paper-l9-raw": 2.0}), commit="fff0000")
    other = tables_run({"raw@1024": 1.0}, [1024])  # measures none of the points
    text = goals_table([("a.json", old), ("b.json", new), ("c.json", other)])
    row = next(line for line in text.splitlines() if "paper-l9-raw" in line)
    assert "1,400,000 tokens/s" in row and "`b.json` (fff0000)" in row and row.endswith("| no |")
    assert text.count("| not measured | – | open |") == 3


def test_the_docs_block_gives_the_measured_numbers():
    """The block of research/GPU.md against the results files' own items."""
    res = ROOT / "research" / "results"
    a = json.loads((res / "gpu-h200-7608a19-a.json").read_text())["sections"]["trainer"]
    c = json.loads((res / "gpu-h200-7608a19-c.json").read_text())["sections"]["tables"]
    text = render(load_snapshot(ROOT / "research" / "GPU.md", "gpu:goals"), "gpu:goals")
    assert f"{a['paper-l9-raw']['tokens_per_s']:,.0f} tokens/s" in text
    hsum = a["paper-l9-engram"]["tokens_per_s"] / a["paper-l9-tngram-hsum"]["tokens_per_s"]
    assert f"closest `-hsum`: {hsum:.3f}× Engram's step" in text
    t32 = c["tngram@32768/sparse"]["median_ms"] / c["tngram@32768/dense"]["median_ms"]
    assert f"TN-gram {t32:.2f}×" in text and f"{t32:.2f}" == "1.38"


def test_a_run_the_order_does_not_list_is_refused(tmp_path):
    run = {"kind": "bench-gpu", "tiny": False, "sections": {}}
    (tmp_path / "gpu-x-1.json").write_text(json.dumps(run))
    (tmp_path / "gpu-x-2.json").write_text(json.dumps(run))
    snap = resolve_index({"order": ["gpu-x-2.json", "gpu-x-1.json"]}, tmp_path)
    assert [n for n, _ in snap["runs"]] == ["gpu-x-2.json", "gpu-x-1.json"]  # the order's
    with pytest.raises(TngramError, match=r"does not list gpu-x-1.json; add it"):
        resolve_index({"order": ["gpu-x-2.json"]}, tmp_path)
