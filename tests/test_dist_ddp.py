"""DDP with 2 gloo processes on CPU == 1 process with doubled gradient accumulation.

The tiny config has a global batch of 512 tokens = micro-batch 4 x 64: one process runs 2
accumulation micro-steps, two torchrun processes run 1 each. The loader gives micro-step i of the
single process exactly the data of rank i, DDP averages the gradients (g0 + g1) / 2 exactly as
accumulating g0 / 2 + g1 / 2 does, and Muon's round-robin orthogonalisation is rounded to bf16 in
both cases. Tolerance: losses within 1e-6 relative and weights within 1e-6 absolute (a change in
summation order could differ in the last float bits; on this machine the runs are bitwise equal).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from test_train_support import (cli_args, losses, one_thread, single_thread, tiny_config,  # noqa: F401
                                tiny_data, weights)
from tngram.train.loop import train

pytestmark = pytest.mark.dist

EXTRA = ["schedule.steps=6", "schedule.warmdown_steps=3", "run.val_every=3", "run.checkpoint_every=0"]


@pytest.mark.parametrize("muon", ["auto", "stacked"])
def test_two_gloo_processes_equal_single_process(tiny_data, tmp_path, monkeypatch, muon):
    """muon: TNGRAM_MUON_IMPL in both runs ("auto" is the CPU's per-matrix loop; "stacked" is
    CUDA's default, where each process stacks only its own share of the matrices)."""
    monkeypatch.setenv("TNGRAM_MUON_IMPL", muon)
    single = tmp_path / "single"
    with single_thread():
        s1 = train(tiny_config(tiny_data, extra=EXTRA), single)
    assert s1["grad_accum_steps"] == 2 and s1["world_size"] == 1

    ddp = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tngram.train", *cli_args(tiny_data, "mini-tngram", ddp, EXTRA)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]

    import json
    s2 = json.loads((ddp / "summary.json").read_text())
    expect = "loop" if muon == "auto" else muon  # what each run's env.json says Muon ran
    for run in (single, ddp):
        assert json.loads((run / "env.json").read_text())["muon_impl"] == expect
    assert s2["world_size"] == 2 and s2["grad_accum_steps"] == 1
    l1, l2 = losses(single), losses(ddp)
    assert sorted(l1) == sorted(l2) == list(range(1, 7))
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-6, abs=0), step
    assert s2["val_loss"] == pytest.approx(s1["val_loss"], rel=1e-6)
    assert s2["val_bpb"] == pytest.approx(s1["val_bpb"], rel=1e-6)
    w1, w2 = weights(single), weights(ddp)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-6)
    # training moved the weights far beyond the tolerance, so the comparison has teeth
    from tngram.model.gpt import GPT
    cfg = tiny_config(tiny_data, extra=EXTRA)
    torch.manual_seed(cfg.run.seed)
    init = GPT(cfg.model).state_dict()
    assert max(float((w1[k] - init[k]).abs().max()) for k in w1) > 1e-2
    assert l1[6] < l1[1] - 0.5


def test_release_ddp_frees_the_wrapper_while_the_group_lives(tmp_path):
    """The exit-hang fix (tngram.train.dist.release_ddp): the DDP wrapper is gone (its Reducer
    freed) when release_ddp returns, i.e. before `shutdown` destroys the process group, even with
    the cycle collector off. A 1-process gloo group stands in for torchrun's; the context claims
    2 processes so that the release runs."""
    import gc
    import weakref
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tngram.train.dist import DistContext, release_ddp
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 2)
        holder = SimpleNamespace(fwd_model=DDP(model))
        holder.fwd_model(torch.randn(3, 4)).sum().backward()       # the Reducer has worked
        gc.disable()                      # freed now, not at some later collection
        try:
            ref = weakref.ref(holder.fwd_model)
            release_ddp(holder, DistContext(0, 0, 2, torch.device("cpu"), "gloo", owns_group=False))
            assert holder.fwd_model is None and ref() is None
        finally:
            gc.enable()
    finally:
        dist.destroy_process_group()
