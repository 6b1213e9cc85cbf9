"""Row-sparse memory updates under DDP: 2 gloo processes == 1 process with doubled accumulation.

As tests/test_dist_ddp.py, with optim.memory_update=sparse (Engram) and rowwise with catch-up
(TN-gram; its per-row state is the same on every process, as the rows are): the
tables are left out of DDP and their sparse gradients all-gathered by
tngram.train.dist.sync_sparse_grads (rows summed over processes, divided by 2), which equals
accumulating the two micro-batches' gradients in one process up to the order of the float sums.
Tolerance: losses within 1e-5 relative, weights within 1e-5 absolute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from test_train_support import (cli_args, losses, single_thread, tiny_config, tiny_data,  # noqa: F401
                                weights)
from tngram.train.loop import train

pytestmark = pytest.mark.dist

EXTRA = ["schedule.steps=5", "schedule.warmdown_steps=2", "run.val_every=0",
         "run.checkpoint_every=0", "optim.grad_clip_norm=0.5"]


@pytest.mark.parametrize("recipe, mode", [("mini-engram", "sparse"), ("mini-tngram", "rowwise+catchup")])
def test_sparse_tables_two_processes_equal_one(tiny_data, tmp_path, recipe, mode):
    mode, _, catchup = mode.partition("+")
    extra = EXTRA + [f"optim.memory_update={mode}"] + (["optim.memory_catchup=true"] if catchup else [])
    single = tmp_path / "single"
    with single_thread():
        train(tiny_config(tiny_data, recipe, extra), single)
    ddp = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tngram.train", *cli_args(tiny_data, recipe, ddp, extra)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ddp / "summary.json").read_text())["world_size"] == 2
    l1, l2 = losses(single), losses(ddp)
    assert sorted(l1) == sorted(l2) == list(range(1, 6))
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5, abs=0), step
    w1, w2 = weights(single), weights(ddp)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5, msg=k)
    # the tables did train (rows moved far beyond the tolerance)
    key = next(k for k in w1 if k.endswith(("table.weight", "factors")))
    cfg = tiny_config(tiny_data, recipe, extra)
    torch.manual_seed(cfg.run.seed)
    from tngram.model.gpt import GPT
    init = GPT(cfg.model).state_dict()[key]
    assert float((w1[key] - init).abs().max()) > 1e-2
