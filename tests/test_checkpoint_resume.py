"""Checkpoints and resume: an interrupted run (clean stop or SIGKILL) resumes bit-identically on CPU.

Reference: one uninterrupted 12-step run of the tiny TN-gram config. The same config is then
(a) stopped after step 5 (max_steps) and resumed, and (b) run as `python -m tngram.train` in a
subprocess that is killed with SIGKILL after it logged step 4 (its last checkpoint is step 3),
then resumed with --resume. Per-step training losses and final weights must be bitwise equal:
every operation is deterministic on CPU, and weights, Adam/Muon state, loader position and RNG
are restored exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_train_support import (cli_args, losses, one_thread, single_thread, tiny_config,  # noqa: F401
                                tiny_data, weights)
from tngram.common import TngramError
from tngram.train import checkpoint as ckpt
from tngram.train.loop import train

EXTRA = ["schedule.steps=12", "schedule.warmdown_steps=5", "run.checkpoint_every=3",
         "run.keep_checkpoints=2", "run.val_every=0"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    with single_thread():
        summary = train(tiny_config(tiny_data, extra=EXTRA), out)
    return out, summary


def assert_same_run(a: Path, b: Path) -> None:
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, 13)) and la == lb          # bitwise equal floats
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_clean_stop_and_resume_is_bit_identical(reference, tiny_data, tmp_path):
    ref, _ = reference
    cfg = tiny_config(tiny_data, extra=EXTRA)
    first = train(cfg, tmp_path, max_steps=5)          # stops (and checkpoints) at step 5
    assert first["steps"] == 5 and ckpt.checkpoint_step(ckpt.latest_checkpoint(tmp_path)) == 5
    summary = train(cfg, tmp_path, resume=True)
    assert summary["steps"] == 12
    assert_same_run(ref, tmp_path)
    assert summary["val_loss"] == reference[1]["val_loss"]
    assert summary["tokens"] == reference[1]["tokens"] == 12 * 512


def test_bf16_autocast_resume_is_bit_identical(tiny_data, tmp_path):
    """The same property with CPU bf16 autocast (the mini recipes' setting), 6 steps."""
    extra = EXTRA + ["run.dtype=bf16", "schedule.steps=6", "schedule.warmdown_steps=2"]
    cfg = tiny_config(tiny_data, extra=extra)
    train(cfg, tmp_path / "ref")
    train(cfg, tmp_path / "run", max_steps=4)
    train(cfg, tmp_path / "run", resume=True)
    assert losses(tmp_path / "ref") == losses(tmp_path / "run") and len(losses(tmp_path / "run")) == 6
    wa, wb = weights(tmp_path / "ref"), weights(tmp_path / "run")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["dtype"] == "bfloat16"


def test_sigkill_between_checkpoints_then_resume(reference, tiny_data, tmp_path):
    ref, _ = reference
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tngram.train", *cli_args(tiny_data, "mini-tngram", run, EXTRA)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 90
    try:
        while time.time() < deadline and proc.poll() is None:
            if max(losses(run), default=0) >= 4:      # step 4 logged; last checkpoint is step 3
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None and time.time() >= deadline:
            proc.kill()
    assert proc.wait() == -signal.SIGKILL, "the run finished (or failed) before it could be killed"
    assert not (run / "summary.json").exists()
    latest = ckpt.latest_checkpoint(run)
    # killed between checkpoints: steps after the last checkpoint (3) were already logged
    assert latest is not None and ckpt.checkpoint_step(latest) == 3 < max(losses(run))
    # a half-written checkpoint folder from a kill during saving is ignored and cleaned up
    junk = run / "checkpoints" / ".tmp-step_000099-1"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"torn")
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed" in resumed.stdout
    assert_same_run(ref, run)
    assert not junk.exists()
    # metrics.jsonl has each step exactly once (rows the killed process wrote were replaced)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))


def test_checkpoint_files_and_retention(reference):
    ref, _ = reference
    kept = ckpt.list_checkpoints(ref)
    # checkpoints at 3, 6, 9, 12 (every 3 + the end); keep_checkpoints=2 leaves the newest two
    assert [ckpt.checkpoint_step(p) for p in kept] == [9, 12]
    for p in kept:
        assert sorted(f.name for f in p.iterdir()) == ["manifest.json", "meta.json", "model.safetensors",
                                                   "state.safetensors"]
        assert ckpt.verify_checkpoint(p) is None
    assert not list((ref / "checkpoints").glob(".tmp-*"))
    meta = json.loads((kept[-1] / "meta.json").read_text())
    assert meta["step"] == 12 and meta["tokens"] == 12 * 512
    assert set(meta["optimizers"]) == {"adam", "muon"}


def test_optimizer_state_roundtrip_without_pickle(reference, tiny_data):
    """Fresh model + optimisers loaded from a checkpoint hold exactly the saved state."""
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups
    from tngram.optim.muon import Muon
    from safetensors.torch import load_file
    ref, _ = reference
    cfg = tiny_config(tiny_data, extra=EXTRA)
    model = GPT(cfg.model)
    groups = build_param_groups(model, cfg.optim)
    o = cfg.optim  # the trainer's settings: a checkpoint's are refused when they differ
    opts = {"adam": torch.optim.Adam([g for g in groups if g["optimizer"] == "adam"],
                                     betas=(o.beta1, o.beta2), eps=o.adam_eps),
            "muon": Muon([g for g in groups if g["optimizer"] == "muon"], lr=o.matrix_lr,
                         nesterov=True, ns_steps=o.muon_ns_steps)}
    latest = ckpt.latest_checkpoint(ref)
    ckpt.load_checkpoint(latest, model, opts, restore_rng_state=False)
    saved = load_file(str(latest / "state.safetensors"))
    n = 0
    for name, opt in opts.items():
        for idx, state in opt.state_dict()["state"].items():
            for k, v in state.items():
                assert torch.equal(v, saved[f"optim/{name}/{idx}/{k}"])
                n += 1
    assert n >= 3 * len(groups)  # Adam: step, exp_avg, exp_avg_sq per tensor; Muon: momentum
    assert opts["muon"].param_groups[0]["momentum"] == pytest.approx(0.95)


def test_load_run_model(reference, tiny_data):
    ref, _ = reference
    model, cfg_dict = ckpt.load_run_model(ref)
    assert not model.training
    assert cfg_dict == json.loads((ref / "config.json").read_text())
    final = weights(ref)
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k])


def test_load_run_model_falls_back_to_latest_checkpoint(reference, tmp_path):
    import shutil
    ref, _ = reference
    run = tmp_path / "partial"
    shutil.copytree(ref, run)
    (run / "model.safetensors").unlink()
    model, _ = ckpt.load_run_model(run)
    w = weights(run, 12)
    assert all(torch.equal(v, w[k]) for k, v in model.state_dict().items())
    with pytest.raises(TngramError, match="not a run folder"):
        ckpt.load_run_model(tmp_path / "nothing")


def test_refuses_to_overwrite_or_resume_a_different_config(reference, tiny_data):
    ref, _ = reference
    with pytest.raises(TngramError, match="--resume"):
        train(tiny_config(tiny_data, extra=EXTRA), ref)
    with pytest.raises(TngramError, match="optim.matrix_lr"):
        train(tiny_config(tiny_data, extra=EXTRA + ["optim.matrix_lr=0.01"]), ref, resume=True)
