"""`--jobs J`: runs trained side by side give the same bits as one after the other, come back in
spec order, keep their output in RUN/worker.log, and a failure stops further runs with one error."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_train_support import tiny_config, tiny_data  # noqa: F401  (session fixture)
from tngram.common import TngramError
from tngram.experiments import runner
from tngram.experiments.runner import RunSpec, job_threads, run_all, run_jobs

FAST = ["schedule.steps=3", "schedule.warmdown_steps=1", "run.val_every=0", "run.checkpoint_every=0",
        "run.log_every=1"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def test_jobs_match_sequential_runs_bit_for_bit(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")          # the same threads in both modes
    specs = [RunSpec("tngram-s0", tiny_config(tiny_data, "mini-tngram", extra=FAST), {"method": "tngram"}),
             RunSpec("raw-s0", tiny_config(tiny_data, "mini-raw", extra=FAST), {"method": "raw"})]
    seq = run_all(specs, tmp_path / "seq")
    with run_jobs(2):
        par = run_all(specs, tmp_path / "par")
    assert [r["label"] for r in par] == ["tngram-s0", "raw-s0"]           # spec order, not finish order
    for a, b in zip(seq, par):
        assert a["val_loss"] == b["val_loss"] and a["train_loss"] == b["train_loss"]
        wa, wb = _weights(Path(a["run_dir"])), _weights(Path(b["run_dir"]))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        log = Path(b["run_dir"]) / "worker.log"
        assert log.is_file() and "step 3/3" in log.read_text()
        assert not (Path(a["run_dir"]) / "worker.log").exists()          # sequential: output inherited


def test_a_failed_job_stops_further_runs_with_one_error(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Both workers are real and start together; good-s0 only *reports* back after bad-s0 has failed
    # (+1 s), so its freed slot is always offered after the failure. Without this the test raced:
    # on a loaded CI machine good-s0 finished before bad-s0 had failed, and later-s0 rightly started.
    real, bad_done = runner._train_one, threading.Event()

    def ordered(i, spec, *rest):
        try:
            return real(i, spec, *rest)
        finally:
            if spec.label == "bad-s0":
                bad_done.set()
            else:
                assert bad_done.wait(300)
                time.sleep(1.0)

    monkeypatch.setattr(runner, "_train_one", ordered)
    good = tiny_config(tiny_data, "mini-raw", extra=FAST)
    bad = tiny_config(tmp_path / "no-such-data", "mini-raw", extra=FAST)
    specs = [RunSpec("bad-s0", bad), RunSpec("good-s0", good), RunSpec("later-s0", good)]
    with run_jobs(2), pytest.raises(TngramError, match=r"run bad-s0 failed \(exit 2\); its output is in .*worker.log"):
        run_all(specs, tmp_path / "o")
    runs = tmp_path / "o" / "runs"
    assert "no-such-data" in (runs / "bad-s0" / "worker.log").read_text()
    assert (runs / "good-s0" / "summary.json").is_file()                # started beside it: finished
    assert not (runs / "later-s0").exists()                             # never started


def test_job_threads_and_the_cli_guard(monkeypatch, capsys, tmp_path):
    import os

    from tngram.cli import main
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert job_threads(1) == str(os.cpu_count())
    assert job_threads(10 * (os.cpu_count() or 1)) == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert job_threads(2) == "3"
    assert main(["compare", "--preset", "cpu", "--jobs", "2", "--nproc", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--jobs 2" in err[0] and "--nproc 2" in err[0] and not (tmp_path / "o").exists()
