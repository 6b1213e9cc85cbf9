"""Hostile command lines (docs/RELIABILITY.md): every numeric option has a range, every report
input is checked, and a full disk is the project's one-line disk-full message. Each refusal is one
line with exit status 2, before any expensive work, and writes nothing."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from test_hostile import cli, full_run, one_line_exit_2  # noqa: F401
from test_train_support import tiny_data  # noqa: F401


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--peak-tflops", "-3"], "--peak-tflops"),
        (["--peak-tflops", "inf"], "--peak-tflops"),
        (["--mfu", "nan"], "--mfu"),
        (["--gpu-mem", "inf"], "--gpu-mem"),
        (["--gpus", "64"], "16 sequences"),  # mini-tngram: 16 sequences per optimiser step
        (["--gpus", "3"], "16 sequences"),
        (["--gpus", str(1 << 30)], "--gpus"),
    ],
)
def test_plan_numbers_out_of_range_are_one_line(argv, needle, capsys):
    rc, err = cli(["plan", "mini-tngram", *argv], capsys)
    one_line_exit_2(rc, err)
    assert needle in err


def test_plan_output_has_positive_throughput(capsys):
    """The values a range admits give a plan with finite positive numbers (16 = 2 x 8)."""
    from tngram.cli.plan import plan

    r = plan("mini-tngram", 2, 80.0, "bf16", 0.35, 312.0)
    assert r["gpus"] == 2 and all(v >= 0 for v in r["static_bytes"].values())


@pytest.mark.parametrize("tuned", ["oe-lrnan", "oe-lr-5", "oe-lrinf", "oe-lr0", "oe-lr1e9"])
def test_pareto_tuned_factor_out_of_range_is_one_line(tuned, tmp_path, capsys):
    out = tmp_path / "p"
    rc, err = cli(["experiment", "pareto", "--tuned", tuned, "--out", str(out)], capsys)
    one_line_exit_2(rc, err)
    assert "must be a finite number in (0, 1000]" in err and not out.exists()


def _compare_folder(tmp_path: Path, row: dict) -> Path:
    d = tmp_path / "cmp"
    d.mkdir()
    (d / "results.json").write_text(
        json.dumps({"preset": "cpu", "data": "x", "rows": [row]}), encoding="utf-8"
    )
    return d


ROW = {
    "method": "raw",
    "seed": 0,
    "run_dir": "runs/raw-s0",
    "train_loss": 5.0,
    "val_loss": 5.1,
    "val_bpb": 1.7,
    "tokens_per_s": 1000.0,
}


@pytest.mark.parametrize("missing", ["val_bpb", "method", "tokens_per_s"])
def test_report_compare_row_lacking_a_field_is_one_line(missing, tmp_path, capsys):
    d = _compare_folder(tmp_path, {k: v for k, v in ROW.items() if k != missing})
    before = (d / "results.json").read_bytes()
    rc, err = cli(["report", "compare", str(d)], capsys)
    one_line_exit_2(rc, err)
    assert f"rows[0]: field {missing!r} is missing" in err
    assert (d / "results.json").read_bytes() == before and not (d / "report.md").exists()


def _doc(tmp_path: Path, body: str) -> Path:
    (tmp_path / "research" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir(exist_ok=True)
    doc = tmp_path / "docs" / "X.md"
    doc.write_text(f"# x\n\n{body}\n", encoding="utf-8")
    return doc


@pytest.mark.parametrize(
    "marker",
    [
        "<!-- BEGIN generated: ../x -->\nold\n<!-- END generated: ../x -->",
        "<!-- BEGIN generated: my table -->\nold\n<!-- END generated: my table -->",
        "<!--BEGIN generated: x-->\nold\n<!--END generated: x-->",
        "<!-- begin generated: x -->\nold\n<!-- end generated: x -->",
        "<!-- BEGIN generated: /etc/x -->\nold\n<!-- END generated: /etc/x -->",
    ],
)
@pytest.mark.parametrize("check", [True, False])
def test_report_doc_refuses_blocks_it_cannot_check(marker, check, tmp_path, capsys):
    doc = _doc(tmp_path, marker)
    before = doc.read_bytes()
    rc, err = cli(["report", "doc", str(doc), *(["--check"] if check else [])], capsys)
    one_line_exit_2(rc, err)
    assert "malformed generated-block marker" in err and "line 3" in err
    assert doc.read_bytes() == before


@pytest.mark.parametrize(
    "body, needle",
    [
        ("<!-- BEGIN generated: x -->\nold", "has no END marker"),
        ("old\n<!-- END generated: x -->", "without its BEGIN"),
        (
            "<!-- BEGIN generated: x -->\n<!-- END generated: x -->\n"
            "<!-- BEGIN generated: x -->\n<!-- END generated: x -->",
            "appears twice",
        ),
    ],
)
def test_report_doc_refuses_unpaired_or_repeated_blocks(body, needle, tmp_path, capsys):
    rc, err = cli(["report", "doc", str(_doc(tmp_path, body)), "--check"], capsys)
    one_line_exit_2(rc, err)
    assert needle in err


def test_report_doc_check_says_how_many_blocks_it_checked(tmp_path, capsys):
    doc = _doc(
        tmp_path,
        "<!-- BEGIN generated: t -->\nstale\n<!-- END generated: t -->",
    )
    snap = {
        "kind": "table",
        "columns": [{"header": "a"}],
        "rows": [[1]],
        "command": "c",
        "commit": "0",
        "machine": "m",
    }
    (tmp_path / "research" / "results" / "t.json").write_text(json.dumps(snap))
    rc, err = cli(["report", "doc", str(doc), "--check"], capsys)
    assert rc == 1 and "'t' differs" in err
    assert main_out(["report", "doc", str(doc), "--check"], capsys).startswith(
        f"{doc}: checked 1 generated block(s): 0 match their results files, 1 differ"
    )
    assert cli(["report", "doc", str(doc)], capsys)[0] == 0
    out = main_out(["report", "doc", str(doc), "--check"], capsys)
    assert "checked 1 generated block(s): 1 match" in out


def main_out(argv: list[str], capsys) -> str:
    from test_hostile import main

    try:
        main(argv)
    except SystemExit:
        pass
    return capsys.readouterr().out


def test_export_with_a_tokenizer_that_is_not_one_is_one_line(full_run, tmp_path, capsys):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x00not a sentencepiece model" * 10)
    out = tmp_path / "hf"
    rc, err = cli(["export", str(full_run), "--hf", str(out), "--tokenizer", str(bad)], capsys)
    one_line_exit_2(rc, err)
    assert str(bad) in err and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]


def test_export_onto_a_full_disk_is_the_disk_full_line(full_run, tmp_path, capsys, monkeypatch):
    """The tokenizer write after the weights hits ENOSPC: the project's disk-full line (DiskFull,
    exit 2), the partial folder removed, nothing at --hf."""
    from tngram.hf import export as ex

    def full(sp_path, folder):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "tokenizer.json"))

    monkeypatch.setattr(ex, "_save_tokenizer", full)
    out = tmp_path / "hf"
    rc, err = cli(["export", str(full_run), "--hf", str(out)], capsys)
    one_line_exit_2(rc, err)
    assert "disk full while writing the export" in err and "internal error" not in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_export_disk_full_inside_a_library_error_is_recognised(tmp_path):
    """safetensors reports a full disk in its own exception's text."""
    from tngram.hf.export import _disk_full

    assert _disk_full(OSError(errno.ENOSPC, "x"))
    assert _disk_full(RuntimeError("I/O error: No space left on device (os error 28)"))
    assert not _disk_full(RuntimeError("something else"))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "threads", "--reps", "0"],
        ["bench", "threads", "--warmup", "-1"],
        ["bench", "threads", "--threads-list", "0"],
        ["bench", "threads", "--seq", "-1"],
        ["bench", "threads", "--batch", "0"],
        ["bench", "vocab", "--max-gb", "0"],
        ["bench", "vocab", "--max-gb", "nan"],
        ["plan", "mini-tngram", "--mfu", "0"],
    ],
)
def test_bench_numbers_out_of_range_are_refused_at_parse_time(argv, capsys):
    rc, err = cli(argv, capsys)
    one_line_exit_2(rc, err)
    assert f"argument {argv[-2]}: must be" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--preset", "cpu", "--seeds", "1000000000"],
        ["experiment", "pareto", "--seeds", "5000"],
    ],
)
def test_seed_counts_beyond_a_thousand_are_refused_at_parse_time(argv, tmp_path, capsys):
    """1000000000 seeds used to plan runs until memory ran out (a hang), before any output."""
    out = tmp_path / "o"
    rc, err = cli([*argv, "--out", str(out)], capsys)
    one_line_exit_2(rc, err)
    assert "argument --seeds: must be an int >= 1 and <= 1000" in err and not out.exists()
