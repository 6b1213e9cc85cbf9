"""SIGTERM / SIGINT during training (tngram.train.signals, docs/RELIABILITY.md): the step in progress
finishes, a checkpoint of it is written, the lock is released, one line says how to resume, the
exit code is 128 + signal; a second signal exits at once. Every interrupted run is resumed and
compared bit for bit with one uninterrupted run of the same config."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from test_train_support import cli_args, losses, one_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.train import checkpoint as ckpt
from tngram.train.loop import train

EXTRA = ["schedule.steps=6", "schedule.warmdown_steps=2", "run.checkpoint_every=0",
         "run.keep_checkpoints=10", "run.val_every=0"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TNGRAM_NO_PROGRESS="1")
PATCHED_TRAIN = """
import os, signal, sys
from tngram.train.loop import Trainer
real = Trainer.train_step
def train_step(self):
    loss = real(self)
    if self.step == {step}:
        for _ in range({times}):
            os.kill(os.getpid(), {sig})
    return loss
Trainer.train_step = train_step
from tngram.train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
# The run holds at the end of step `step` until the test creates the file `go` (it does so once
# the signal's handler has answered), so a signal from outside always lands inside that step and
# no test depends on timing. Test code only: the package has no pause.
PAUSE_AFTER_STEP = """
import sys, time
from pathlib import Path
from tngram.train.loop import Trainer
real = Trainer.train_step
def train_step(self):
    loss = real(self)
    if self.step == {step}:
        go = Path({go!r})
        print("test: holding after step {step}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 120
        while not go.exists():
            if time.monotonic() > deadline:
                sys.exit(f"test: {{go}} never appeared")
            time.sleep(0.01)
    return loss
Trainer.train_step = train_step
"""
PAUSED_TRAIN = PAUSE_AFTER_STEP + """
from tngram.train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
PAUSED_WORKER = PAUSE_AFTER_STEP + """
from tngram.experiments.worker import main
sys.exit(main())
"""


def read_until(proc: subprocess.Popen, text: str) -> str:
    """proc's stderr up to and including the first line holding `text` (all of it when the
    process ends first: the caller's assertion then shows it)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            break
    return "".join(seen)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("signals-ref")
    torch.set_num_threads(1)
    train(tiny_config(tiny_data, extra=EXTRA), out, progress=False)
    return out


def same_as_reference(ref: Path, run: Path) -> None:
    assert losses(run) == losses(ref) and sorted(losses(run)) == list(range(1, 7))
    wa, wb = weights(ref), weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def resume(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tngram.train", *args, "--resume", "--no-progress"],
                          env=ENV, capture_output=True, text=True, timeout=180)


# SIGINT: test_external_sigint_... below; SIGHUP: a closed terminal, handled like SIGTERM
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_at_a_random_step_checkpoints_that_step_and_resume_is_identical(sig, reference,
                                                                              tiny_data, tmp_path):
    step = random.Random().randint(1, 5)                   # 1..5 of 6, a new one each run
    run = tmp_path / "run"
    args = cli_args(tiny_data, "mini-tngram", run, EXTRA)
    code = PATCHED_TRAIN.format(step=step, times=1, sig=int(sig))
    stopped = subprocess.run([sys.executable, "-c", code, *args, "--no-progress"], env=ENV,
                             capture_output=True, text=True, timeout=180)
    assert stopped.returncode == 128 + sig, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr
    last = [x for x in stopped.stderr.splitlines() if x.strip()][-1]
    assert f"stopped by {sig.name} after step {step}" in last and "--resume" in last
    assert f"step_{step:06d}" in last
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [step]
    assert not (run / "model.safetensors").exists()
    again = resume(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "took over the lock" not in again.stdout          # the lock was released on the way out
    assert f"resumed {run} from step_{step:06d}" in again.stdout
    same_as_reference(reference, run)


def test_second_signal_exits_at_once_and_resume_from_the_last_checkpoint_is_identical(
        reference, tiny_data, tmp_path):
    run = tmp_path / "run"
    extra = EXTRA[:2] + ["run.checkpoint_every=2"] + EXTRA[3:]
    args = cli_args(tiny_data, "mini-tngram", run, extra)
    code = PATCHED_TRAIN.format(step=3, times=2, sig=int(signal.SIGTERM))
    stopped = subprocess.run([sys.executable, "-c", code, *args, "--no-progress"], env=ENV,
                             capture_output=True, text=True, timeout=180)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert "second SIGTERM: exiting at once" in stopped.stderr
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [2]   # step 3 not saved
    again = resume(args + ["--set", "run.checkpoint_every=2"])
    assert again.returncode == 0, again.stderr[-2000:]
    same_as_reference(reference, run)


def test_external_sigint_while_training_then_resume_is_identical(reference, tiny_data, tmp_path):
    """A real SIGINT from outside while step 2 is in progress (the run holds at the end of step 2
    until the handler's line is out): step 2 is checkpointed, exit 130, the resume is identical."""
    run, go = tmp_path / "run", tmp_path / "go"
    args = cli_args(tiny_data, "mini-tngram", run, EXTRA)
    code = PAUSED_TRAIN.format(step=2, go=str(go))
    proc = subprocess.Popen([sys.executable, "-c", code, *args, "--no-progress"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        err = read_until(proc, "test: holding after step 2")
        assert "test: holding after step 2" in err, err[-2000:]
        proc.send_signal(signal.SIGINT)
        err += read_until(proc, "tngram: SIGINT: finishing this step")
        assert "tngram: SIGINT: finishing this step" in err, err[-2000:]
        go.touch()
        err += proc.stderr.read()
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130 and "Traceback" not in err, err[-2000:]
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert "stopped by SIGINT after step 2" in last and "step_000002" in last
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [2]
    again = resume(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed {run} from step_000002" in again.stdout
    same_as_reference(reference, run)


RUNNER = """
import json, sys
from pathlib import Path
from tngram.experiments import runner
from tngram.experiments.runner import RunSpec, run_all
from tngram.train.config import TrainConfig
if len(sys.argv) > 3:                          # the worker's code (PAUSED_WORKER) instead
    runner.launch_command = lambda nproc: [sys.executable, "-c", sys.argv[3]]
cfg = TrainConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
run_all([RunSpec("tiny", cfg)], Path(sys.argv[2]))
"""


def test_sigterm_to_the_compare_runner_reaches_its_worker_and_rerun_is_identical(reference, tiny_data,
                                                                                 tmp_path):
    """SIGTERM to the parent of a worker subprocess (what `compare` / `experiment` run) while the
    worker is in step 2 (it holds there until its handler's line is out): the parent forwards it
    once, the worker checkpoints step 2, both exit 143; running again resumes."""
    cfg_file, go = tmp_path / "cfg.json", tmp_path / "go"
    cfg_file.write_text(json.dumps(tiny_config(tiny_data, extra=EXTRA).to_dict()))
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", textwrap.dedent(RUNNER), str(cfg_file), str(out)]
    worker = PAUSED_WORKER.format(step=2, go=str(go))
    parent = subprocess.Popen(cmd + [worker], env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        stderr = read_until(parent, "test: holding after step 2")
        assert "test: holding after step 2" in stderr, stderr[-2000:]
        parent.send_signal(signal.SIGTERM)
        stderr += read_until(parent, "tngram: SIGTERM: finishing this step")   # the worker's
        assert "tngram: SIGTERM: finishing this step" in stderr, stderr[-2000:]
        go.touch()
        stderr += parent.stderr.read()
        parent.wait(timeout=180)
    finally:
        go.touch()                      # a worker left behind by a failed assertion goes on
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.count("the running training run(s) finish their step") == 1   # the parent, once
    assert "run the same command again" in stderr.splitlines()[-1]
    # the worker's own line gives the same advice: the runner rejects --resume and resumes itself
    assert "--resume" not in stderr and "it resumes this run from its checkpoint" in stderr
    assert "stopped by SIGTERM after step 2" in stderr
    run = out / "runs" / "tiny"
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [2]
    assert not (run / "summary.json").exists()
    again = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-2000:]
    same_as_reference(reference, run)


def test_closing_the_terminal_checkpoints_the_last_step_and_resume_is_identical(
        reference, tiny_data, tmp_path):
    """A run in a pseudo-terminal (its session's controlling terminal, progress shown) whose
    terminal is closed while step 2 is in progress: the kernel's hangup SIGHUP checkpoints step
    2, exit 129 with the terminal gone, and the resume is identical."""
    import pty
    import select
    import time

    run, go = tmp_path / "run", tmp_path / "go"
    args = cli_args(tiny_data, "mini-tngram", run, EXTRA)
    code = PAUSED_TRAIN.format(step=2, go=str(go))
    env = {k: v for k, v in ENV.items() if k != "TNGRAM_NO_PROGRESS"}
    pid, master = pty.fork()  # the child: a new session, the terminal's slave side its tty
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", code, *args], env)
    seen, deadline = b"", time.monotonic() + 120
    try:
        # the whole line (the terminal writes \r\n): a write cut by the hangup is not the test
        while b"holding after step 2\r\n" not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child ended and closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
        assert b"holding after step 2\r\n" in seen, seen[-2000:]
        os.close(master)  # the terminal closes: the kernel hangs up its session
        master = -1
        go.touch()
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        assert done[0] == pid, "the run did not stop after its terminal closed"
    finally:
        if master >= 0:
            os.close(master)
        if "done" not in locals() or done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(done[1]) == 128 + signal.SIGHUP
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [2]
    assert not (run / "model.safetensors").exists()
    again = resume(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed {run} from step_000002" in again.stdout
    same_as_reference(reference, run)
