"""Optimiser-state bytes by optim.memory_update: the one rule (tngram.optim.memory_update.
param_state_bytes) that `tngram plan` and `python -m research experiment pareto` count by, against the state
tensors real optimiser steps allocate.

The independent count: a tiny model of each memory family is built for real, gets the trainer's
optimisers (build_param_groups + setup_memory_update: torch Adam, Muon, and LazyAdam /
RowwiseAdam for the tables under sparse / rowwise), one forward/backward (row-sparse table
gradients under sparse / rowwise) and one step; then the bytes of every state tensor are summed.
torch Adam's 0-d `step` tensor (4 B per parameter tensor) is left out, as the rule says.
The expected rowwise bytes are also derived from the config's table widths (Engram head dim =
n_embed_per_ngram / n_head_per_ngram, TN-gram cp_rank, hybrid hash_embed / hash_heads,
Over-Encoding slice width), not from the tensors' shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_train_support import tiny_data  # noqa: F401 (fixture)
from tngram.common import TngramError
from tngram.memory import with_memory_fields
from tngram.model.gpt import GPT
from tngram.optim.groups import build_param_groups, memory_table_params
from tngram.optim.memory_update import (MEMORY_UPDATES, optimizer_state_bytes, param_state_bytes,
                                        setup_memory_update)
from tngram.optim.muon import Muon

FAMILIES = {"engram": {"table_budget": (7, 7, 7, 7), "n_embed_per_ngram": 32},
            "tngram": {"cp_rank": 8},
            "tngram-hybrid": {"cp_rank": 6, "hash_orders": (2,), "hash_heads": 2, "hash_embed": 12},
            "oe": {"table_rows": 11}}


def _cfg(family: str, mode: str, catchup: bool = False):  # noqa: ANN202
    from tngram.experiments.common import base_recipe
    cfg = base_recipe("mini", family.split("-")[0])
    m = cfg.model
    mem = with_memory_fields(m.memory, **FAMILIES[family])  # the hybrid: kind tngram-variant
    return replace(cfg, model=replace(m, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, vocab_size=64,
                                      sequence_len=16, memory_layers=(0, 1), memory=mem),
                   optim=replace(cfg.optim, memory_update=mode, memory_catchup=catchup))


def _width(cfg, p_shape) -> int:  # noqa: ANN001
    """A table's row length from the config (which table: told apart by its rank)."""
    mem, d = cfg.model.memory, cfg.model.n_embd
    kind = mem.kind
    if kind == "engram":
        return mem.embed_per_ngram(d) // mem.n_head_per_ngram
    if kind == "oe":
        return mem.slice_width(d)
    return mem.cp_rank if len(p_shape) == 3 else mem.hash_embed // mem.hash_heads


def _held(cfg) -> dict[str, int]:  # noqa: ANN001
    """Bytes of the state tensors the trainer's optimisers hold after one real step."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    o = cfg.optim
    groups = build_param_groups(model, o)
    table_opt, rest = setup_memory_update(model, groups, o.memory_update, (o.beta1, o.beta2), o.adam_eps,
                                          o.memory_catchup)
    opts = [torch.optim.Adam([g for g in rest if g["optimizer"] == "adam"], betas=(o.beta1, o.beta2),
                             eps=o.adam_eps),
            Muon([g for g in rest if g["optimizer"] == "muon"], lr=o.matrix_lr, momentum=o.muon_momentum,
                 nesterov=True, ns_steps=o.muon_ns_steps)]
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.sequence_len),
                        generator=torch.Generator().manual_seed(1))
    model(ids, ids).backward()
    tables = memory_table_params(model)
    assert tables and all(p.grad is not None for p in model.parameters())
    assert all(p.grad.is_sparse == (o.memory_update != "dense") for p in tables)
    for opt in opts + ([table_opt] if table_opt is not None else []):
        opt.step()
    table_ids = {id(p) for p in tables}
    out = {"tables": 0, "rest": 0}
    for opt in opts:
        for p, st in opt.state.items():
            b = sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
            out["tables" if id(p) in table_ids else "rest"] += b
    if table_opt is not None:                 # its step counter is an int: every tensor is state
        assert set(table_opt.state) == set(tables)
        out["tables"] += optimizer_state_bytes(table_opt, tables)
        # catch-up's lr history grows with the steps, not the table: not counted per parameter
        out["tables"] -= sum(st["lr_history"].numel() * 8 for st in table_opt.state.values()
                             if "lr_history" in st)
    out["table_params"] = sum(p.numel() for p in tables)
    out["rows"] = sum(p.numel() // _width(cfg, p.shape) for p in tables)
    out["by_config"] = sum(4 * p.numel() + 4 * p.numel() // _width(cfg, p.shape) for p in tables)
    return out


@pytest.mark.parametrize("mode", list(MEMORY_UPDATES) + ["sparse+catchup", "rowwise+catchup"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_and_pareto_count_the_state_real_optimiser_steps_allocate(family, mode):
    from tngram.cli.plan import state_bytes
    from research.experiments.pareto_report import optimizer_state_bytes as pareto_bytes
    mode, _, catchup = mode.partition("+")
    cfg = _cfg(family, mode, bool(catchup))
    last = 4 * _held(cfg)["rows"] if catchup else 0     # catch-up: + the last step of each row (int32)
    held = _held(cfg)
    with torch.device("meta"):
        planned = state_bytes(GPT(cfg.model), cfg.optim)
    assert planned["memory_table_state"] == held["tables"]
    assert planned["adam_state"] + planned["muon_state"] == held["rest"]
    assert planned["memory_table_params"] == held["table_params"]
    assert pareto_bytes(cfg)["total"] == held["tables"] + held["rest"]
    if mode == "rowwise":   # 4 + 4/width B per table parameter, width from the config
        assert held["tables"] == held["by_config"] + last < 8 * held["table_params"]
    else:                   # dense Adam and LazyAdam: two fp32 moments
        assert held["tables"] == 8 * held["table_params"] + last


def test_plan_cli_takes_memory_update_and_moves_only_the_table_state(capsys):
    """mini-engram planned dense vs --set optim.memory_update=rowwise on 2 GPUs: Adam/Muon and
    weights unchanged, the tables' state drops to 4 + 4/head_dim B per parameter and the tables
    leave DDP's buckets."""
    import json

    from tngram.cli import main
    runs = {}
    for mode in ("dense", "rowwise"):
        extra = [] if mode == "dense" else ["--set", "optim.memory_update=rowwise"]
        assert main(["plan", "mini-engram", "--gpus", "2", "--json", *extra]) == 0
        runs[mode] = json.loads(capsys.readouterr().out)
    d, r = runs["dense"], runs["rowwise"]
    assert (d["memory_update"], r["memory_update"]) == ("dense", "rowwise")
    tp, P = d["memory_table_params"], d["params"]
    assert tp == r["memory_table_params"] > 0
    from tngram.train.recipes import get_recipe
    m = get_recipe("mini-engram").model
    head_dim = m.memory.embed_per_ngram(m.n_embd) // m.memory.n_head_per_ngram
    ds, rs = d["static_bytes"], r["static_bytes"]
    assert ds["memory_table_state"] == 8 * tp
    assert rs["memory_table_state"] == 4 * tp + 4 * tp // head_dim
    assert ds["ddp_buckets"] == 4 * P and rs["ddp_buckets"] == 4 * (P - tp)
    for k in ("weights", "gradients", "adam_state", "muon_state"):
        assert ds[k] == rs[k], k
    assert d["static_total_bytes"] - r["static_total_bytes"] == (8 * tp - rs["memory_table_state"]) + 4 * tp
    assert main(["plan", "mini-engram", "--set", "optim.memory_update=rowwise"]) == 0
    assert "optim.memory_update=rowwise" in capsys.readouterr().out
    assert main(["plan", "mini-engram", "--set", "optim.memory_update=lazy"]) == 2
    assert "optim.memory_update" in capsys.readouterr().err


def test_param_state_bytes_rule_and_its_errors():
    # width 8 rows: 3*5 rows of 8 -> 4*120 + 4*15; Muon 4 B; a non-table Adam tensor ignores the mode
    assert param_state_bytes("adam", (3, 5, 8), "rowwise", table=True) == 4 * 120 + 4 * 15
    assert param_state_bytes("adam", (3, 5, 8), "sparse", table=True) == 8 * 120
    assert param_state_bytes("adam", (3, 5, 8), "rowwise", table=False) == 8 * 120
    assert param_state_bytes("muon", (6, 4)) == 4 * 24
    with pytest.raises(TngramError, match="memory_update"):
        param_state_bytes("adam", (4,), "lazy")
    with pytest.raises(TngramError, match="optimizer"):
        param_state_bytes("sgd", (4,))


def test_hybrid_hashed_table_gets_the_touched_rows_of_the_dense_gradient():
    """TN-gram hybrid (hash_orders): under sparse/rowwise its hashed table, like the CP factors,
    gets a row-sparse gradient (before, a dense one: LazyAdam/RowwiseAdam then touched every row,
    and DDP's sync_sparse_grads refused it) whose rows are the dense gradient's, bit for bit."""
    from tngram.optim.memory_update import set_sparse_grads
    cfg = _cfg("tngram-hybrid", "dense")
    cfg = replace(cfg, model=replace(cfg.model, memory=replace(cfg.model.memory, zero_init_value=False)))
    models = []
    for sparse in (False, True):
        torch.manual_seed(0)
        models.append(GPT(cfg.model))
        if sparse:
            set_sparse_grads(models[-1], True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    for m in models:
        m(ids, ids).backward()
    dense, sparse = ([p for p in memory_table_params(m) if p.dim() == 2] for m in models)
    assert len(dense) == len(sparse) == 2                     # one hashed table per memory layer
    for pd, ps in zip(dense, sparse):
        assert ps.grad.is_sparse and not pd.grad.is_sparse
        g = ps.grad.coalesce()
        assert g.indices().shape[1] < ps.shape[0]                # not every row
        assert torch.equal(g.to_dense(), pd.grad) and pd.grad.abs().sum() > 0


@pytest.mark.dist
def test_hybrid_rowwise_two_processes_equal_one(tiny_data, tmp_path):  # noqa: F811
    """The hybrid's hashed table under DDP with optim.memory_update=rowwise: its sparse rows are
    all-gathered like the factors' (a dense gradient there made sync_sparse_grads refuse the run);
    2 gloo processes equal 1 with doubled accumulation, as tests/test_dist_memory.py."""
    import json
    import os
    import subprocess
    import sys

    from test_train_support import cli_args, losses, single_thread, tiny_config, weights
    from tngram.train.loop import train
    extra = ["schedule.steps=3", "schedule.warmdown_steps=1", "run.val_every=0", "run.checkpoint_every=0",
             "optim.memory_update=rowwise", "model.memory.hash_orders=[2]", "model.memory.hash_heads=2",
             "model.memory.hash_embed=16"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    with single_thread():
        train(tiny_config(tiny_data, "mini-tngram", extra), single)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tngram.train", *cli_args(tiny_data, "mini-tngram", ddp, extra)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ddp / "summary.json").read_text())["world_size"] == 2
    l1, l2 = losses(single), losses(ddp)
    assert sorted(l1) == sorted(l2) == [1, 2, 3]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5, abs=0), step
    w1, w2 = weights(single), weights(ddp)
    hashed = [k for k in w1 if k.endswith("hashed.table.weight")]
    assert hashed
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5, msg=k)
