"""What a newcomer sees: the overall ETA of compare/experiment runs, one-seed reports without a
spread, the loss figure without a panel of lone dots, and runs named after the memory they have."""

from __future__ import annotations

import json
import statistics
import struct

from test_train_support import one_thread, tiny_data  # noqa: F401
from tngram.experiments.runner import RunClock
from tngram.report.compare import compare_table


def test_run_clock_elapsed_and_eta_from_the_mean_run_time():
    clock = RunClock(3, now=100.0)
    # one run in 90 s: two left at 90 s each
    assert clock.finished(now=190.0) == "1/3 trained, 1 min 30 s elapsed, about 3 min 00 s left"
    # two runs in 200 s: mean 100 s, one left
    assert clock.finished(now=300.0) == "2/3 trained, 3 min 20 s elapsed, about 1 min 40 s left"
    assert clock.finished(now=400.0) == "3/3 trained, 5 min 00 s elapsed"


def _rows(seeds: list[int]) -> list[dict]:
    rows = []
    for s in seeds:
        for m, base in (("raw", 3.70), ("engram", 3.36), ("tngram", 3.35)):
            v = base + 0.01 * s
            rows.append({"method": m, "seed": s, "delta_params": 0 if m == "raw" else 1_000_000,
                         "train_loss": v + 0.03, "val_loss": v, "val_bpb": v / 2, "tokens_per_s": 1000.0,
                         "run_dir": f"runs/{m}-s{s}"})
    return rows


def test_one_seed_report_prints_no_spread():
    table = compare_table({"preset": "cpu", "rows": _rows([0])})
    assert "±" not in table
    assert "| TN-gram | 1.00M | 3.3800 | 3.3500 | 1.6750 | 1,000 |" in table
    assert "One seed (no spread" in table
    # TN-gram - Engram of the one seed, no "mean ± std"
    assert "paired by seed (same init and data order): -0.0100 (negative = TN-gram better)" in table


def test_two_seed_report_prints_the_sample_std():
    table = compare_table({"preset": "cpu", "rows": _rows([0, 1])})
    sd = statistics.stdev([3.35, 3.36])          # TN-gram val loss over seeds 0 and 1
    assert f"| 3.3550 ± {sd:.4f} |" in table and "Mean ± std over 2 seeds" in table


def _png_width(path) -> int:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", head[16:20])[0]


def _run(folder, val_steps: list[int]):
    folder.mkdir(parents=True)
    rows = [{"step": s, "train_loss": 5.0 - s / 100} for s in range(10, 110, 10)]
    rows += [{"step": s, "val_loss": 4.0 - s / 200} for s in val_steps]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_loss_figure_has_a_validation_panel_only_for_curves(tmp_path):
    from tngram.report.plots import loss_curves
    one = {"raw": [_run(tmp_path / "a", [100])], "tngram": [_run(tmp_path / "b", [100])]}
    many = {"raw": [_run(tmp_path / "c", [50, 100])], "tngram": [_run(tmp_path / "d", [100])]}
    # figsize 6.5 x 4 in (one panel) or 11 x 4 in (two) at 120 dpi
    assert _png_width(loss_curves(one, tmp_path / "one.png")) == 780
    assert _png_width(loss_curves(many, tmp_path / "many.png")) == 1320


def test_a_run_whose_settings_change_the_memory_is_named_for_it():
    from tngram.train.recipes import resolve_config
    assert resolve_config("mini-raw", ["model.memory.kind=tngram", "model.memory.cp_rank=64"]).name \
        == "mini-raw+memory=tngram"
    assert resolve_config("mini-tngram", ["model.memory.kind=none"]).name == "mini-tngram+memory=none"
    assert resolve_config("mini-tngram", ["model.memory.kind=engram"]).name == "mini-tngram+memory=engram"
    # same family (other settings of it), back to the recipe's family, or an explicit name: unchanged
    assert resolve_config("mini-tngram", ["model.memory.cp_rank=64"]).name == "mini-tngram"
    assert resolve_config("mini-raw", ["model.memory.kind=tngram", "model.memory.kind=none"]).name == "mini-raw"
    assert resolve_config("mini-raw", ["model.memory.kind=tngram", "name=mine"]).name == "mine"


def test_compare_rows_changed_by_set_are_reported_as_what_they_are():
    from tngram.experiments.runner import RunSpec, _overridden
    from tngram.train.recipes import get_recipe
    specs = {m: RunSpec(f"{m}-s0", get_recipe(f"mini-{m}"), {"method": m, "seed": 0}) for m in ("raw", "engram")}
    raw, engram = (_overridden(s, ("model.memory.kind=engram",)) for s in specs.values())
    assert raw.tags == {"method": "raw+memory=engram", "seed": 0} and raw.config.model.memory.kind == "engram"
    assert engram.tags == {"method": "engram", "seed": 0}
    # folder label and config name stay (finished runs are found again)
    assert raw.label == "raw-s0" and raw.config.name == "mini-raw"
    assert _overridden(specs["raw"], ("optim.matrix_lr=0.02",)).tags["method"] == "raw"


def test_compare_ends_with_next_commands_that_parse(tmp_path):
    import shlex
    from pathlib import Path

    from tngram.cli.main import build_parser
    from tngram.experiments.compare import next_steps
    out = tmp_path / "my compare"                         # a space: the paths are quoted
    rows = [{"method": "raw", "run_dir": str(out / "runs" / "raw-s0")},
            {"method": "tngram", "run_dir": str(out / "runs" / "tngram-s0")}]
    text = next_steps(out, rows, out / "loss_curves.png")
    cmds = [ln.split("    #")[0].strip() for ln in text.splitlines() if ln.strip().startswith("tngram ")]
    assert len(cmds) == 2
    parser = build_parser()
    for c in cmds:
        args = parser.parse_args(shlex.split(c)[1:])
        assert Path(args.run_dir) == out / "runs" / "tngram-s0"
    assert f"{out / 'report.md'}" in text and "loss_curves.png" in text


def test_eval_bpb_differs_from_training_validation_only_by_bf16_autocast(tiny_data, tmp_path, capsys):
    import torch

    from test_train_support import tiny_config
    from tngram import load_run
    from tngram.cli.main import main
    from tngram.data.bpb import token_byte_luts
    from tngram.data.build import open_dataset
    from tngram.data.loader import load_val_tokens
    from tngram.data.tokenizer import load_tokenizer
    from tngram.eval.bpb import evaluate_bpb
    from tngram.train.loop import train
    cfg = tiny_config(tiny_data, extra=["schedule.steps=3", "run.val_every=0", "run.checkpoint_every=0",
                                        "run.dtype=bf16"])
    summary = train(cfg, tmp_path / "run", progress=False)
    said = capsys.readouterr()
    # the slow-bf16 note appears exactly on a CPU without AVX-512 (oneDNN's bf16 matmul needs
    # avx512bw/vl/dq; read independently from the kernel's CPU flags where Linux has them)
    import platform
    from pathlib import Path
    if Path("/proc/cpuinfo").exists() and platform.machine() == "x86_64":
        flags = set(Path("/proc/cpuinfo").read_text().split())
        native = {"avx512bw", "avx512vl", "avx512dq"} <= flags
        assert ("no native bf16 matmul" in said.out + said.err) is (not native)
    assert main(["eval", "bpb", str(tmp_path / "run"), "--json"]) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert main(["eval", "bpb", str(tmp_path / "run")]) == 0
    assert "training validated under bf16 autocast" in capsys.readouterr().out
    # recomputed independently: the summary is the bf16-autocast evaluation, eval bpb the fp32 one
    model, _ = load_run(tmp_path / "run")
    info = open_dataset(str(tiny_data))
    val = load_val_tokens(info.val_files, cfg.model.sequence_len, cfg.model.vocab_size)
    luts = token_byte_luts(load_tokenizer(info.tokenizer_path), cfg.model.vocab_size)
    ev = {dt: evaluate_bpb(model, val, cfg.model.sequence_len, luts, 4, autocast_dtype=dt,
                           max_tokens=cfg.data.val_tokens)["val_loss"] for dt in (None, torch.bfloat16)}
    assert abs(fp32["val_loss"] - ev[None]) < 1e-9
    assert abs(summary["val_loss"] - ev[torch.bfloat16]) < 1e-9


def test_experiment_tables_show_no_spread_for_one_seed():
    from research.experiments.sweeps import _table
    from research.report.plots import fmt_pm
    assert fmt_pm(3.5, 0.0, 1) == "3.5000" and fmt_pm(3.5, 0.01234, 3) == "3.5000 ± 0.0123"
    assert fmt_pm(-0.5, 0.2, 2, "+.2f") == "-0.50 ± 0.20"
    series = {"tngram": [(3.0, 3.5, 0.0), (5.0, 3.4, 0.0)]}
    assert "±" not in _table(series, "N", seeds=1)
    assert "| 3 | 3.5000 ± 0.0000 |" in _table(series, "N", seeds=2)


def test_a_run_made_before_the_memory_naming_still_resumes(tiny_data, tmp_path):
    from test_train_support import tiny_config
    from tngram.train.loop import train
    sets = ["model.memory.kind=tngram", "model.memory_layers=1", "model.memory.cp_rank=16",
            "model.memory.max_ngram=3", "run.val_every=0", "run.checkpoint_every=2"]
    old = tiny_config(tiny_data, "mini-raw", extra=sets + ["name=mini-raw"])    # as named before
    train(old, tmp_path / "run", max_steps=2, progress=False)
    new = tiny_config(tiny_data, "mini-raw", extra=sets)
    assert new.name == "mini-raw+memory=tngram"
    s = train(new, tmp_path / "run", resume=True, progress=False)
    assert s["steps"] == 8
