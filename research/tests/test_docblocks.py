"""Generated doc blocks (research.report.docblocks): cell formats, the check, and bad input."""

from __future__ import annotations

from research.cli import main as research_main
import json
import shutil
import statistics
from pathlib import Path

import pytest

from tngram.cli import main
from tngram.common import MissingFileError, TngramError
from research.report.docblocks import check_doc, current_block, render, render_cell

ROOT = Path(__file__).resolve().parents[2]
M = "\u2212"


def test_cell_formats_against_hand_values():
    vals = [3.3580, 3.3550, 3.3610]
    m, s = statistics.fmean(vals), statistics.stdev(vals)   # 3.3580, 0.0030
    assert render_cell(vals, "mean_std:.4f") == f"{m:.4f} ± {s:.4f}" == "3.3580 ± 0.0030"
    assert render_cell([-0.0090, 0.0004], "list:+.4f") == f"{M}0.0090, +0.0004"
    assert render_cell([-0.0063, -0.0037], "mean_std:+.4f") == f"{M}0.0050 ± 0.0018"  # std has no sign
    assert render_cell(0.5822, "pct:.1f") == "58.2%"
    assert render_cell(5683200, "params") == "5.68M"
    assert render_cell(4329544, ",") == "4,329,544"
    assert render_cell(None, ".4f") == "–" and render_cell("3 (commit x)", ".4f") == "3 (commit x)"
    assert render_cell({"value": 3.35171, "bold": True}, ".4f") == "**3.3517**"
    assert render_cell([3.5], "mean_std:.4f") == "3.5000"          # one seed: no ± 0
    with pytest.raises(TngramError, match="needs a list"):
        render_cell(3.0, "mean_std:.4f")
    with pytest.raises(TngramError, match="unknown cell format"):
        render_cell(3.0, "median:.4f")


def _doc(tmp_path: Path, snap: dict, name: str = "t") -> Path:
    (tmp_path / "research" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "research" / "results" / f"{name}.json").write_text(json.dumps(snap))
    doc = tmp_path / "docs" / "X.md"
    doc.write_text(f"# x\n\n<!-- BEGIN generated: {name} -->\nold\n<!-- END generated: {name} -->\n\nafter\n")
    return doc


TABLE = {"kind": "table", "command": "python -m research experiment x --seeds 2", "commit": "abc1234",
         "machine": "2-core AMD EPYC", "columns": [{"header": "method"}, {"header": "val loss", "fmt": "mean_std:.4f"}],
         "rows": [["Engram", [3.0, 3.2]]]}


def test_report_doc_regenerates_and_check_catches_an_edit(tmp_path):
    doc = _doc(tmp_path, TABLE)
    assert research_main(["report", "doc", "--check", str(doc)]) == 1          # "old" is not the rendering
    assert research_main(["report", "doc", str(doc)]) == 0
    block = current_block(doc.read_text(), "t")
    # mean 3.1, sample std sqrt(((0.1)^2 * 2) / 1) = 0.1414
    assert "| Engram | 3.1000 ± 0.1414 |" in block
    assert "`research/results/t.json` (`python -m research experiment x --seeds 2` at commit abc1234; 2-core AMD EPYC)" in block
    assert doc.read_text().endswith("\n\nafter\n")
    assert research_main(["report", "doc", "--check", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("3.1000", "3.1001"))
    assert check_doc(doc) == ["t"]


@pytest.mark.parametrize("cell, fmt, needle", [
    ([3.0, None, 3.2], "mean_std:.4f", "value 2 of 3 (one per seed) is None"),
    ([3.0, float("nan")], "mean_std:.4f", "value 2 of 2 (one per seed) is nan"),
    (float("nan"), ".4f", "a number belongs in this cell, got nan"),
    ("abc", ".4f", "a number belongs in this cell (format '.4f'), got 'abc'"),
    (3.0, ".4q", "bad format code '.4q'"),
])
def test_a_block_never_shows_nan_a_word_for_a_number_or_averages_a_seed_away(cell, fmt, needle):
    snap = dict(TABLE, columns=[{"header": "method"}, {"header": "v", "fmt": fmt}], rows=[["x", cell]])
    with pytest.raises(TngramError) as e:
        render(snap, "t")
    assert str(e.value).startswith("research/results/t.json: ") and needle in str(e.value), e.value


def test_a_results_file_missing_a_key_is_named_not_a_bug():
    with pytest.raises(TngramError, match=r"^research/results/t.json: field 'header' is missing$"):
        render(dict(TABLE, columns=[{"header": "method"}, {"fmt": ".4f"}]), "t")


@pytest.mark.parametrize("text, needle", [
    ('{"kind": "table", "v": NaN}', "field v holds NaN"),
    ('{"kind": "bench-threads", "rows": [{"step_ms": -5}]}', "field rows[0].step_ms must be a time"),
    ('{"kind": "x", "tokens_per_s": "fast"}', "field tokens_per_s must be a time or rate"),
    ('{"kind": "x", "runs": {"a": {"steps": 40.5}}}', "field runs.a.steps must be an int >= 0"),
    ('{"kind": "x", "tokens_per_step": true}', "field tokens_per_step must be an int >= 0"),
    ('{"kind": "x", "commit": ["abc"]}', "field commit must be a string"),
    ("[1, 2]", "expected a JSON object"),
    ("[" * 5000 + "]" * 5000, "nested more than"),
])
def test_a_results_file_is_read_strictly_before_any_block_is_written(text, needle, tmp_path,
                                                                      capsys):
    doc = _doc(tmp_path, TABLE)
    (tmp_path / "research" / "results" / "t.json").write_text(text)
    before = doc.read_text()
    assert research_main(["report", "doc", str(doc)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "t.json: " in err and needle in err, err
    assert doc.read_text() == before


def test_bad_results_files_fail_with_one_clear_line(tmp_path):
    with pytest.raises(TngramError, match="'commit' is missing"):
        render({k: v for k, v in TABLE.items() if k != "commit"}, "t")
    with pytest.raises(TngramError, match="unknown kind"):
        render(dict(TABLE, kind="plot"), "t")
    with pytest.raises(TngramError, match="2 cells for 1 columns"):
        render(dict(TABLE, columns=TABLE["columns"][:1]), "t")
    doc = _doc(tmp_path, TABLE, name="t")
    (tmp_path / "research" / "results" / "t.json").unlink()
    with pytest.raises(MissingFileError, match="t.json, which is missing"):
        check_doc(doc)
    assert research_main(["report", "doc", str(tmp_path / "nope.md")]) == 2


def test_speed_views_and_performance_tables_come_from_one_bench_file(tmp_path):
    """The compact speed view and PERFORMANCE.md's tables are views of one results file: a changed
    median there makes PERFORMANCE.md disagree, and the ratios and targets shown follow the file."""
    snap = json.loads((ROOT / "research/results/bench-threads-8a1a1d7.json").read_text())
    perf = ROOT / "research" / "PERFORMANCE.md"
    speed = render(snap, "bench-threads-8a1a1d7:speed")
    t = snap["times"]
    en, tn = 1000 * t["lookup:engram@1"]["median_s"], 1000 * t["lookup:tngram@1"]["median_s"]
    assert f"| {en:.2f} | {tn:.2f} | {snap['ratios']['1']['lookup']:.2f} |" in speed
    assert abs(tn / en - snap["ratios"]["1"]["lookup"]) < 0.01            # ratio consistent with times
    r = snap["ratios"]
    step_met = max(round(r["1"]["step"], 2), round(r["2"]["step"], 2)) <= 1.10  # the step target
    assert f"≤ {1.05 * snap['flop_ratio']:.2f}" in speed
    assert ("≤ 1.10 (not met)" in speed) == (not step_met)
    targets = current_block(perf.read_text(), "bench-threads-8a1a1d7:targets")
    verdict = "yes" if step_met else "**no**"
    assert f"| mini step ≤ 1.10 | {r['1']['step']:.2f} | {r['2']['step']:.2f} | {verdict} |" in targets
    (tmp_path / "research" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir(exist_ok=True)
    shutil.copy(perf, tmp_path / "research" / "PERFORMANCE.md")
    t["lookup:engram@1"]["median_s"] = 0.00841
    (tmp_path / "research/results/bench-threads-8a1a1d7.json").write_text(json.dumps(snap))
    for f in (ROOT / "research/results").glob("*.json"):          # the other blocks' files, unchanged
        if f.name != "bench-threads-8a1a1d7.json":
            shutil.copy(f, tmp_path / "research/results/")
    assert render(snap, "bench-threads-8a1a1d7:speed") != speed
    assert check_doc(tmp_path / "research" / "PERFORMANCE.md") == ["bench-threads-8a1a1d7:candidates"]


def test_a_block_inside_a_list_item_keeps_its_indentation(tmp_path):
    doc = _doc(tmp_path, TABLE)
    doc.write_text("- item\n\n  <!-- BEGIN generated: t -->\n  old\n  <!-- END generated: t -->\n- next\n")
    assert research_main(["report", "doc", str(doc)]) == 0
    lines = doc.read_text().splitlines()
    assert "  | Engram | 3.1000 ± 0.1414 |" in lines and lines[-2] == "  <!-- END generated: t -->"
    assert check_doc(doc) == []


def test_bench_threads_json_is_a_results_file(monkeypatch, capsys):
    """`python -m research bench threads --json` adds kind, command and commit, so its output can be committed
    as research/results/NAME.json and rendered. The measurement is replaced by the committed run's
    numbers (what is tested is the CLI's results-file fields and the rendering, not the timing)."""
    import subprocess

    import research.bench.threads as threads
    snap = json.loads((ROOT / "research/results/bench-threads-1ef1ab0.json").read_text())
    measured = {k: v for k, v in snap.items() if k not in ("kind", "command", "commit", "source")}
    measured["machine"] = {"cpu": "AMD EPYC", "logical_cpus": 2, "torch": "2.13.0+cpu",
                           "loadavg_before": [1.11, 1.4, 4.3], "loadavg": [1.23, 1.41, 4.24]}
    monkeypatch.setattr(threads, "run", lambda *a, **k: measured)
    assert research_main(["bench", "threads", "--reps", "9", "--warmup", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout[:7]
    assert out["kind"] == "bench-threads" and out["command"] == "python -m research bench threads --reps 9 --warmup 2 --json"
    assert out["commit"].startswith(head or "unknown")
    block = render(out, "x:speed")
    assert block.split("\n\n")[0] == render(snap, "x:speed").split("\n\n")[0]
    assert "2-core AMD EPYC, torch 2.13.0+cpu, load average 1.11 -> 1.23 during the run" in block


def test_prose_speed_numbers_follow_the_results_files():
    """The few numbers quoted in prose equal their results files: the demo's TN-gram / Engram
    tokens/s and val loss (README, PERFORMANCE.md, RESULTS.md) and the mini step's slowdown."""
    demo = {r["method"]: r for r in json.loads((ROOT / "research/results/demo-compare-cpu.json").read_text())["rows"]}
    bench = json.loads((ROOT / "research/results/bench-threads-8a1a1d7.json").read_text())
    tn, en = demo["tngram"]["tokens_per_s"], demo["engram"]["tokens_per_s"]
    readme, perf = (ROOT / "README.md").read_text(), (ROOT / "research/PERFORMANCE.md").read_text()
    assert f"it trained at {tn / en:.2f}× Engram's tokens/s" in " ".join(readme.split())
    assert f"TN-gram at {tn:,.0f} tokens/s against Engram's {en:,.0f} (**{tn / en:.2f}×**" in " ".join(perf.split())
    results = " ".join((ROOT / "research/RESULTS.md").read_text().split())
    assert f"(the demo's run, multi-threaded C lookup, has TN-gram " \
           f"{demo['tngram']['val_loss']:.4f};" in results
    slower = round(100 * (bench["ratios"]["1"]["step"] - 1))
    assert f"a training step is {slower}% slower than Engram's" in " ".join(readme.split())
    # the README's GPU sentence: the 40-step trainer file's tokens/s and step ratios to Engram
    gpu = json.loads((ROOT / "research/results/gpu-h200-7608a19-a.json").read_text())["sections"]["trainer"]
    tps = {r: gpu[f"paper-l9-{r}"]["tokens_per_s"] for r in ("raw", "engram", "tngram", "tngram-hsum", "tngram-sum-lean")}
    flat = " ".join(readme.split())
    assert " / ".join(f"{tps[r] / 1e6:.2f}M" for r in ("raw", "engram", "tngram")) + " tokens/s" in flat
    assert f"`paper-l9-tngram-hsum` ({tps['engram'] / tps['tngram-hsum']:.2f}×)" in flat
    assert f"`-sum-lean` ({tps['engram'] / tps['tngram-sum-lean']:.2f}×" in flat
    bpb = {r: v["val_bpb"] for r, v in gpu.items()}
    assert min(bpb, key=bpb.get) == "paper-l9-tngram-sum-lean"  # "lowest validation loss"


def test_register_counts_in_gpu_md_follow_their_results_file():
    """research/GPU.md's register counts of the Triton backward (compiled for sm_90 without a GPU)
    are research/scripts/triton_registers.py's, from research/results/triton-registers.json."""
    regs = json.loads((ROOT / "research/results/triton-registers.json").read_text())["recipes"]
    gpu = " ".join((ROOT / "research/GPU.md").read_text().split())
    tn, sm = regs["paper-l9-tngram"]["by_warps"]["4"], regs["paper-l9-tngram-sum"]["by_warps"]["8"]
    fused, rows = tn["backward fused"], tn["backward split, rows"]
    assert f"It needs {fused['registers']} registers a thread at `paper-l9-tngram` (R 1,024, 4 " \
           f"warps), which leaves {fused['warps_per_sm']} warps resident per SM" in gpu
    assert f"and {sm['backward fused']['registers']} at `-sum` (R 1,520, 8 warps: " \
           f"{sm['backward fused']['warps_per_sm']} warps per SM)" in gpu
    assert f"Without the tile the rows kernel needs {rows['registers']} " \
           f"({rows['warps_per_sm']} warps per SM) and {sm['backward split, rows']['registers']}." in gpu
    so, lean = tn["backward sorted, rows"], regs["paper-l9-tngram-sum-lean"]["by_warps"]["8"]
    assert f"{so['registers']} a thread at `paper-l9-tngram` (4 warps; `fused` " \
           f"{fused['registers']}) and {lean['backward sorted, rows']['registers']} at " \
           f"`-sum-lean` (8 warps; `fused` {lean['backward fused']['registers']}, so " \
           f"{lean['backward sorted, rows']['warps_per_sm']} warps per SM against " \
           f"{lean['backward fused']['warps_per_sm']};" in gpu
    for r in regs.values():  # "at twice the warps ... as many registers or fewer, as many warps"
        lo, hi = (r["by_warps"][w] for w in sorted(r["by_warps"], key=int))
        assert all(hi[k]["registers"] <= lo[k]["registers"] for k in lo)
        assert all(hi[k]["warps_per_sm"] >= lo[k]["warps_per_sm"] for k in lo)


def test_one_machine_name_everywhere():
    """Every CPU number here was measured on one 2-core AMD EPYC: the docs never call it anything
    else, and every committed results file names it (the GPU files name their card instead)."""
    docs = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "research").glob("*.md"))
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        assert "Intel" not in text and "Xeon" not in text, doc
    for f in sorted((ROOT / "research" / "results").glob("*.json")):
        snap = json.loads(f.read_text())
        if snap.get("kind") in ("bench-gpu", "gpu-check", "gpu-index"):
            continue
        where = snap.get("machine") or snap.get("platform")
        if isinstance(where, str) and "Linux" not in where:
            assert "AMD EPYC" in where, f
