"""python -m research.bench.hf_decode: its results file's shape, and the numbers PERFORMANCE.md
and docs/HF.md quote from the committed run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "research" / "results" / "hf-decode-53dcb8f.json"


def test_a_short_run_times_every_candidate(tmp_path):
    from research.bench.hf_decode import main

    out = tmp_path / "r.json"
    assert main(["--tokens", "3", "--prompt", "4", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"raw", "engram", "tngram", "hooks only"}
    assert res["rows"]["raw"]["cpu_overhead"] == 0.0
    for row in res["rows"].values():
        assert row["cpu_ms_per_token"] > 0 and row["wall_ms_per_token"] > 0
    assert res["command"].startswith("python -m research.bench.hf_decode --tokens 3 ")


def test_docs_quote_the_committed_run():
    res = json.loads(RUN.read_text())
    perf = " ".join((ROOT / "research" / "PERFORMANCE.md").read_text().split())
    hf = " ".join((ROOT / "docs" / "HF.md").read_text().split())
    assert res["commit"] == "53dcb8f" and res["reps"] == 40
    for name, label in (("raw", "raw"), ("engram", "Engram"), ("tngram", "TN-gram"),
                        ("hooks only", "hooks only")):
        r = res["rows"][name]
        cells = [f"{r['cpu_ms_per_token']:.2f}", f"{r['cpu_tokens_per_s']:.1f}"]
        if name != "raw":
            cells.append(f"{100 * r['cpu_overhead']:+.1f}%")
        assert f"| {label} | {' | '.join(cells)} |" in perf, label
    tn, en = (100 * res["rows"][k]["cpu_overhead"] for k in ("tngram", "engram"))
    assert f"adds {tn:.1f}% (TN-gram) and {en:.1f}% (Engram) of CPU time" in hf
