"""FSDP2 (run.parallel=fsdp) with 2 gloo processes on CPU against 1 process.

The tiny TN-gram config (global batch 512 tokens = 2 micro-batches of 4 x 64) trained for 20 steps
by 2 torchrun processes with every block and its memory sharded (tngram.train.fsdp) and by 1
process (no sharding, 2 accumulation micro-steps). The goal: equal within 1e-5 relative loss
in fp32 over 20 steps. Measured on this machine: bitwise equal (every loss and every final weight).
Before apply_fsdp gave a tensor passed twice to a unit its own view node
(tngram.train.fsdp._split_repeated_inputs), the tied embedding's gradient differed by ~2e-9
from step 2 on (FSDP2's post-backward Function summed the first block's x and x0 gradient parts
in another order) and Muon's bf16 Newton-Schulz amplified it: relative loss difference 2.7e-7 at
step 4, 8.4e-5 at 6, 5.2e-4 at 20 (same config, warmdown 3). Tolerances here: 1e-6 relative loss,
1e-6 absolute weight (as tests/test_dist_ddp.py; the old difference fails them from step 5).
Checkpoints of 2 processes go through torch.distributed.checkpoint (tngram.train.sharded_checkpoint:
one file of shards per process, listed in the manifest, the gathered weights beside them): saved
by 2 processes at step 5 and continued by 1 or by 2, or saved by 1 (the usual full-tensor files)
and continued by 2, the run equals the uninterrupted 1-process run to the same tolerances
(measured: bitwise); a changed or added shard is refused. A memory attached to a
transformers model (tngram.hf) trains under fully_shard: 2 processes equal 1 within 1e-6 over 4
AdamW steps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train_support import (cli_args, losses, single_thread, tiny_config, tiny_data,  # noqa: F401
                                weights)
from tngram.common import TngramError
from tngram.train import checkpoint as ckpt
from tngram.train import sharded_checkpoint as shckpt
from tngram.train.loop import train

pytestmark = pytest.mark.dist

STEPS, SAVE_AT = 20, 5
EXTRA = [f"schedule.steps={STEPS}", "schedule.warmdown_steps=6", "run.val_every=0",
         f"run.checkpoint_every={SAVE_AT}", "run.parallel=fsdp"]
TOL = 1e-6   # relative loss and absolute weight tolerance (the goal is 1e-5 relative loss)
HERE = Path(__file__).resolve().parent


def torchrun(args: list[str], timeout: float = 200) -> subprocess.CompletedProcess:
    """2 processes on a port torchrun picks (--standalone); PYTHONFAULTHANDLER: a process that
    crashes prints its Python stack into the stderr the assertions show."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


# `tngram.train` as users run it; the wrapper only counts, when train() destroys the process
# group, the FSDP-sharded modules still in memory (collected or not): none may be, else the
# group's last reference goes with whichever garbage collection comes later (dist.release_ddp)
COUNTING_TRAIN = """
import gc, os, sys
import tngram.train.loop as loop
from torch.distributed.fsdp import FSDPModule
real = loop.shutdown
def shutdown(ctx):
    alive = sum(FSDPModule in type(o).__mro__ for o in gc.get_objects())
    print(f"test: rank {os.environ['RANK']}: {alive} FSDP modules alive at shutdown", flush=True)
    real(ctx)
loop.shutdown = shutdown
from tngram.train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-single")
    with single_thread():
        s = train(tiny_config(tiny_data, extra=EXTRA), out)
    assert s["world_size"] == 1 and s["grad_accum_steps"] == 2
    return out, s


@pytest.fixture(scope="module")
def fsdp_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("fsdp-two") / "run"
    proc = torchrun(["--no-python", sys.executable, "-c", COUNTING_TRAIN,
                     *cli_args(tiny_data, "mini-tngram", run, EXTRA)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = re.findall(r"test: rank (\d): (\d+) FSDP modules alive at shutdown", proc.stdout)
    assert sorted(counts) == [("0", "0"), ("1", "0")], proc.stdout[-3000:]
    return run


def assert_same_run(run: Path, ref: Path) -> None:
    """Every step's training loss within TOL relative and the final weights within TOL absolute."""
    lr, l1 = losses(run), losses(ref)
    assert sorted(lr) == sorted(l1) == list(range(1, STEPS + 1))
    for step in l1:
        assert lr[step] == pytest.approx(l1[step], rel=TOL, abs=0), step
    w, w1 = weights(run), weights(ref)
    assert w.keys() == w1.keys()
    for k in w1:
        torch.testing.assert_close(w[k], w1[k], rtol=0, atol=TOL, msg=k)


def test_fsdp_two_processes_match_one(single_run, fsdp_run):
    single, s1 = single_run
    s2 = json.loads((fsdp_run / "summary.json").read_text())
    assert s2["world_size"] == 2 and s2["grad_accum_steps"] == 1
    l1 = losses(single)
    assert l1[STEPS] < l1[1] - 1.0                   # it trained
    # the weights file holds full (unsharded) tensors with the names and shapes of 1 process
    assert_same_run(fsdp_run, single)
    assert json.loads((fsdp_run / "config.json").read_text())["run"]["parallel"] == "fsdp"


@pytest.fixture(scope="module")
def fsdp_stopped(tiny_data, tmp_path_factory):
    """2 processes stopped after step SAVE_AT: one sharded (DCP) checkpoint."""
    run = tmp_path_factory.mktemp("fsdp-stopped") / "run"
    proc = torchrun(["-m", "tngram.train", *cli_args(tiny_data, "mini-tngram", run, EXTRA),
                     "--stop-after", str(SAVE_AT)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_fsdp_checkpoint_is_sharded_through_dcp(fsdp_stopped, single_run):
    """One file of DCP shards per process, listed in the manifest; the gathered weights beside
    them are the 1-process run's weights at that step; a changed or added shard is refused."""
    single, _ = single_run
    c = ckpt.latest_checkpoint(fsdp_stopped)
    assert ckpt.checkpoint_step(c) == SAVE_AT and shckpt.is_sharded_checkpoint(c)
    meta = ckpt.read_checkpoint_meta(c)
    assert meta["world_size"] == 2 and meta["format"] == "sharded"
    shards = sorted(p.name for p in (c / ckpt.DCP_DIR).iterdir())
    assert len(shards) == 2 and all(n.endswith(".safetensors") for n in shards)
    manifest = json.loads((c / ckpt.MANIFEST).read_text())
    assert sorted(manifest["shards"]) == shards
    assert ckpt.verify_checkpoint(c) is None
    # each file holds that process's rows: the two row counts of a sharded matrix add up
    from safetensors import safe_open
    rows = []
    for n in shards:
        with safe_open(str(c / ckpt.DCP_DIR / n), "pt") as f:
            rows.append(f.get_slice("model/tok_emb.weight").get_shape()[0])
    w1 = weights(single, SAVE_AT)
    assert sum(rows) == w1["tok_emb.weight"].shape[0] and min(rows) > 0
    wc = weights(fsdp_stopped, SAVE_AT)
    for k in w1:
        torch.testing.assert_close(wc[k], w1[k], rtol=0, atol=TOL, msg=k)


def test_fsdp_checkpoint_with_a_bad_shard_is_refused(fsdp_stopped, tiny_data, tmp_path, capsys):
    """A flipped bit in a shard, an added file in dcp/ or a missing manifest: the checkpoint does
    not verify, and resuming says so in one line per checkpoint and refuses."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(fsdp_stopped, run)
    c = ckpt.latest_checkpoint(run)
    extra = c / ckpt.DCP_DIR / "extra.safetensors"
    extra.write_bytes(b"x")
    assert ckpt.verify_checkpoint(c) == f"{ckpt.DCP_DIR}/extra.safetensors is not in the manifest"
    extra.unlink()
    shard = sorted((c / ckpt.DCP_DIR).iterdir())[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    reason = f"{ckpt.DCP_DIR}/{shard.name} does not match its sha256 in the manifest (corrupt)"
    assert ckpt.verify_checkpoint(c) == reason
    with single_thread(), pytest.raises(TngramError, match="none of its 1 checkpoint"):
        train(tiny_config(tiny_data, extra=EXTRA), run, resume=True)
    assert f"skipping checkpoint {c.name}: {reason}" in capsys.readouterr().out
    (c / ckpt.MANIFEST).unlink()
    assert ckpt.verify_checkpoint(c) == "manifest.json is missing (a sharded checkpoint is always written with one)"


def test_fsdp_checkpoint_resumes_in_one_process(single_run, fsdp_stopped, tiny_data, tmp_path):
    """Sharded (DCP) checkpoint of 2 processes at step SAVE_AT, continued by 1 (full tensors read
    from the shards): the uninterrupted 1-process run's numbers."""
    import shutil
    single, _ = single_run
    run = tmp_path / "fsdp"
    shutil.copytree(fsdp_stopped, run)
    with single_thread():
        s = train(tiny_config(tiny_data, extra=EXTRA), run, resume=True)
    assert s["steps"] == STEPS and s["world_size"] == 1
    assert_same_run(run, single)


def test_fsdp_checkpoint_resumes_in_two_processes_from_shards(single_run, fsdp_stopped, tiny_data,
                                                              tmp_path):
    """The same sharded checkpoint continued by 2 processes (each reads its own rows)."""
    import shutil
    single, _ = single_run
    run = tmp_path / "fsdp"
    shutil.copytree(fsdp_stopped, run)
    proc = torchrun(["-m", "tngram.train", *cli_args(tiny_data, "mini-tngram", run, EXTRA), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert_same_run(run, single)
    # its later checkpoints are sharded too, the final weights gathered
    assert shckpt.is_sharded_checkpoint(ckpt.latest_checkpoint(run))


def test_fsdp_checkpoint_resumes_in_two_processes(single_run, tiny_data, tmp_path):
    """Saved by 1 process at step SAVE_AT, continued by 2 sharded processes (each keeps its shard
    of the full tensors): the uninterrupted 1-process run's numbers."""
    single, _ = single_run
    run = tmp_path / "one-then-two"
    with single_thread():
        train(tiny_config(tiny_data, extra=EXTRA), run, max_steps=SAVE_AT)
    assert ckpt.read_checkpoint_meta(ckpt.latest_checkpoint(run))["world_size"] == 1
    proc = torchrun(["-m", "tngram.train", *cli_args(tiny_data, "mini-tngram", run, EXTRA),
                     "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint was written with 1 processes, resuming with 2" in proc.stdout
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == STEPS and s["world_size"] == 2
    assert_same_run(run, single)


def test_hf_model_with_memory_trains_under_fully_shard():
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, str(HERE / "fsdp_hf_worker.py")], env=env,
                         capture_output=True, text=True, timeout=200)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun([str(HERE / "fsdp_hf_worker.py")])
    assert two.returncode == 0, two.stderr[-3000:]
    a = json.loads(one.stdout.strip().splitlines()[-1])
    b = json.loads(two.stdout.strip().splitlines()[-1])
    assert not a["sharded"] and b["sharded"]          # the memory's factors were DTensor shards
    assert len(a["losses"]) == len(b["losses"]) == 4
    for x, y in zip(a["losses"], b["losses"]):
        assert y == pytest.approx(x, rel=1e-6)
    assert a["losses"][0] != a["losses"][-1]
