"""The first hour (issue 43.6): one thread rule and --threads for every command that computes,
said in one line; ETAs that count the final validation and checkpoint, and compare's ETA that
costs each remaining run by its family; report.md's tokens/s with threads and load; the resume
hint of a run inside compare; make install's PATH hint; dist/ ignored."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from test_train_support import one_thread, tiny_config, tiny_data  # noqa: F401
from tngram.cpu import CpuFacts, ThreadChoice, choose_threads, thread_rule
from tngram.experiments.runner import RESUME_HINT, RunClock, child_env
from tngram.train.metrics import Progress, tail_seconds

ROOT = Path(__file__).resolve().parents[1]


# ---- threads ----------------------------------------------------------------------------------
def test_thread_rule_is_trains_rule_and_says_why():
    busy = CpuFacts(affinity=2, others_busy=1.0, loadavg=2.5)
    idle = CpuFacts(affinity=2, others_busy=0.1, loadavg=0.3)
    assert thread_rule(3, "cpu", 2, "evaluating") == (3, "3 threads (--threads 3)")
    n, line = thread_rule(0, "cuda", 2, "evaluating")
    assert n == 2 and "cuda computes" in line
    n, line = thread_rule(0, "cpu", 2, "evaluating", omp="1")
    assert n == 2 and "OMP_NUM_THREADS=1" in line
    # busy: one thread per CPU the other jobs leave free (choose_threads), said with the verb
    n, line = thread_rule(0, "cpu", 2, "evaluating", choose=lambda d: choose_threads(busy, d, "evaluating"))
    assert n == 1 and "evaluating with 1 thread instead of 2" in line and "load average 2.50" in line
    n, line = thread_rule(0, "cpu", 2, "sampling", choose=lambda d: choose_threads(idle, d, "sampling"))
    assert (n, line) == (2, "2 threads (torch's default: other jobs at normal priority kept 0.1 "
                            "of 2 CPUs busy, niced ones 0.0; load average 0.30; --threads N chooses)")
    one = ThreadChoice(1, 1, False, "")
    assert thread_rule(0, "cpu", 1, "sampling", choose=lambda d: one)[0] == 1


@pytest.fixture(scope="module")
def tiny_run(tiny_data, tmp_path_factory):  # noqa: F811
    from test_train_support import single_thread
    from tngram.train.loop import train

    run = tmp_path_factory.mktemp("h43") / "run"
    cfg = tiny_config(tiny_data, "mini-raw", ["schedule.steps=2", "run.val_every=0",
                                              "run.checkpoint_every=0"])
    with single_thread():
        train(cfg, run, progress=False)
    return run


@pytest.mark.parametrize("cmd", [["sample", "--prompt", "ab", "--max-new-tokens", "2"],
                                 ["eval", "bpb", "--json", "--max-tokens", "64"]])
def test_sample_and_eval_take_threads_and_say_what_they_chose(cmd, tiny_run, capsys):
    from tngram.cli.main import main

    args = cmd[:1] + ([cmd[1]] if cmd[0] == "eval" else []) + [str(tiny_run)]
    args += cmd[2:] if cmd[0] == "eval" else cmd[1:]
    torch.set_num_threads(2)
    assert main(args + ["--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "tngram: threads: 1 thread (--threads 1)" in err.splitlines()
    assert torch.get_num_threads() == 1
    torch.set_num_threads(1)
    assert main(args) == 0  # the automatic rule: one line naming the count it runs with
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tngram: threads:")]
    assert len(lines) == 1 and lines[0].startswith(f"tngram: threads: {torch.get_num_threads()} ")


def test_report_md_puts_threads_and_load_beside_tokens_per_s(tiny_run, tmp_path):
    from tngram.report.compare import write_compare_report

    env = json.loads((tiny_run / "env.json").read_text())
    assert env["torch_threads"] == 1 and isinstance(env["loadavg_1min"], float)
    row = {"method": "raw", "seed": 0, "delta_params": 0, "train_loss": 5.0, "val_loss": 5.0,
           "val_bpb": 2.0, "tokens_per_s": 1234.0, "run_dir": str(tiny_run)}
    write_compare_report(tmp_path, {"preset": "cpu", "data": "d", "rows": [row]})
    text = (tmp_path / "report.md").read_text()
    assert f"| 1,234 (1 thread, load {env['loadavg_1min']:.2f}) |" in text


# ---- ETAs -------------------------------------------------------------------------------------
def test_tail_is_the_final_validation_and_checkpoint():
    # measured: what this session's validation and checkpoint took
    assert tail_seconds(2.0, 4096, 131072, val_s=7.0, save_s=0.5) == 7.5
    # not yet measured: a forward over val_tokens (32 steps' tokens) at 1/3 of a step's time per
    # token, plus one step for the checkpoint: 2 * 32 / 3 + 2
    assert tail_seconds(2.0, 4096, 131072) == pytest.approx(2.0 * 32 / 3 + 2.0)


def test_progress_eta_includes_the_tail(capsys):
    p = Progress(4, 0, "x", enabled=True, bar=False, log_every=1, tail=lambda step_s: 100.0)
    p.update(1.0, 10.0)
    err = capsys.readouterr().err
    assert "ETA 1 min 40 s" in err  # steps take ~0 s here; the tail is the 100 s


def test_compare_eta_costs_runs_by_family_and_work():
    runs = [("raw-s0", "raw", 1.0), ("tngram-s0", "tngram", 1.0), ("raw-s1", "raw", 1.0),
            ("tngram-s1", "tngram", 2.0), ("engram-s1", "engram", 1.0)]
    clock = RunClock(5, now=0.0, runs=runs)
    # raw-s0 took 10 s: every run left at 10 s per unit of work: 10 + 10 + 20 + 10 = 50 s
    assert clock.finished(now=10.0, label="raw-s0", run_s=10.0).endswith("about 50 s left")
    # tngram-s0 took 20 s: raw-s1 10 s, tngram-s1 (2 units) 40 s, engram (unmeasured) at the
    # mean of the finished (30 s / 2 units = 15 s): 65 s
    assert clock.finished(now=30.0, label="tngram-s0", run_s=20.0).endswith("1 min 05 s left")
    # the same runs overlapping (--jobs 2): scaled by elapsed / own seconds = 18 / 30: 39 s
    clock = RunClock(5, now=0.0, runs=runs)
    clock.finished(now=10.0, label="raw-s0", run_s=10.0)
    assert clock.finished(now=18.0, label="tngram-s0", run_s=20.0).endswith("about 39 s left")


# ---- hints and install ------------------------------------------------------------------------
def test_a_run_inside_compare_is_told_what_resumes_it(monkeypatch):
    from tngram.train.loop import resume_hint

    monkeypatch.delenv("TNGRAM_RESUME_HINT", raising=False)
    assert resume_hint() == "run the same command with --resume"  # tngram train
    env = child_env(1)
    assert env["TNGRAM_RESUME_HINT"] == RESUME_HINT and "--resume" not in RESUME_HINT
    monkeypatch.setenv("TNGRAM_RESUME_HINT", env["TNGRAM_RESUME_HINT"])
    assert resume_hint() == RESUME_HINT
    assert child_env(2)["OMP_NUM_THREADS"]


def test_make_install_ends_with_the_path_hint_and_dist_is_ignored():
    # --no-print-directory: under `make test` this runs inside make, which would add
    # "make[1]: Leaving directory ..." as the last line
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "install"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    assert "bin/activate" in out.stdout.strip().splitlines()[-1]
    ignored = subprocess.run(["git", "check-ignore", "-q", "dist/tngram-0.1.0.whl"], cwd=ROOT)
    assert ignored.returncode == 0


def test_the_progress_bar_shows_the_tail_beside_tqdms_remaining():
    p = Progress(4, 0, "x", enabled=True, bar=True, log_every=1, tail=lambda step_s: 100.0)
    p.update(1.0, 10.0)
    assert p.bar.postfix.endswith("then=1 min 40 s val+ckpt")
    p.close()


def test_train_says_its_threads_in_its_header(tiny_data, tmp_path, capsys):  # noqa: F811
    from tngram.train.loop import train

    cfg = tiny_config(tiny_data, "mini-raw", ["schedule.steps=1", "run.val_every=0",
                                              "run.checkpoint_every=0", "run.threads=1"])
    train(cfg, tmp_path / "run", progress=False)
    assert "; device cpu (1 thread); autocast" in capsys.readouterr().out
