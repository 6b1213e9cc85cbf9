"""optim.memory_catchup: lazy table updates that add, when a row is read again, the moves dense
Adam made on it while it was not read (tngram.optim.memory_update, module docstring).

Independent computation: a float64 brute force that runs the optimiser's formula on EVERY row at
EVERY step (moments decayed with a zero gradient where a row was not read; a row is updated once it
has any history), with a different lr at each step. With eps = 0 that is what catch-up must equal
(its closed form leaves eps out of the missed moves), after each step on the rows just read, and
on all rows through `settled()` / `settle()`. Also: gaps longer than the truncation horizon,
betas where b1/sqrt(b2) >= 1 (no truncation), eps = 1e-8 (the stated approximation), exact
restore after `settled()`, training that resumes bit-identically, and the config rules.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_train_support import single_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.common import TngramError
from tngram.kernels.sparse_rows import sparse_row_grad
from tngram.optim.lazy_rows import _horizon
from tngram.optim.memory_update import LazyAdam, RowwiseAdam, settle_tables
from tngram.train.loop import train

ROWS, WIDTH = 12, 5


def _schedule(n_steps: int, seed: int = 3) -> list[list[int]]:
    """Rows read at each step: row 0 always, row 1 never, the others now and then (gaps up to
    ~10 steps), row 2 at step 1 and at the last step only."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(1, n_steps + 1):
        rows = [0] + [r for r in range(3, ROWS) if float(torch.rand((), generator=g)) < 0.25]
        if t in (1, n_steps):
            rows.append(2)
        out.append(sorted(set(rows)))
    return out


def _grad(rows: list[int], t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(len(rows), WIDTH, generator=g, dtype=torch.float64) * (1 + torch.arange(len(rows)).unsqueeze(1))


def _lr(t: int) -> float:
    return 0.05 * (1.0 if t < 20 else 0.5 + 0.02 * (t % 7))     # changes step by step


def _brute(schedule, b1, b2, eps, rowwise: bool, upto: int | None = None) -> torch.Tensor:
    """Every row, every step, float64 (the optimiser's own formula, dense)."""
    torch.manual_seed(0)
    w = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    m = torch.zeros_like(w)
    v = torch.zeros(ROWS, dtype=torch.float64) if rowwise else torch.zeros_like(w)
    seen = torch.zeros(ROWS, dtype=torch.bool)
    for t, rows in enumerate(schedule[:upto], 1):
        g = torch.zeros_like(w)
        g[rows] = _grad(rows, t)
        seen[rows] = True
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (g.square().mean(1) if rowwise else g.square())
        lr = _lr(t)
        for r in range(ROWS):
            if not seen[r]:
                continue
            if rowwise:
                w[r] -= lr / (1 - b1 ** t) * m[r] / (math.sqrt(v[r] / (1 - b2 ** t)) + eps)
            else:
                w[r] -= lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[r] / (v[r].sqrt() + eps)
    return w


def _run(schedule, b1, b2, eps, rowwise: bool, check=None):  # noqa: ANN001
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, WIDTH, dtype=torch.float64))
    opt = (RowwiseAdam if rowwise else LazyAdam)([p], lr=0.05, betas=(b1, b2), eps=eps, catchup=True)
    for t, rows in enumerate(schedule, 1):
        p.grad = sparse_row_grad(torch.tensor(rows), _grad(rows, t), p.shape)
        opt.param_groups[0]["lr"] = _lr(t)
        opt.step()
        p.grad = None
        if check is not None:
            check(t, rows, p, opt)
    return p, opt


@pytest.mark.parametrize("rowwise", [False, True], ids=["sparse", "rowwise"])
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.99, 0.9)], ids=["r<1", "r>=1"])
def test_catchup_equals_dense_adam_on_every_row(rowwise, betas):
    b1, b2 = betas
    schedule = _schedule(40)
    # RowwiseAdam keeps its per-row v in fp32: ~1e-7 relative per step, lr 0.05, 40 steps
    tol, atol = (1e-6, 1e-7) if rowwise else (1e-10, 1e-12)

    def check(t, rows, p, opt):  # noqa: ANN001
        ref = _brute(schedule, b1, b2, 0.0, rowwise, upto=t)
        # the rows read at step t are up to date; with settled() every row is, and after it the
        # weights are exactly the optimiser's own again
        torch.testing.assert_close(p.detach()[rows], ref[rows], rtol=tol, atol=atol)
        before = p.detach().clone()
        with opt.settled():
            torch.testing.assert_close(p.detach(), ref, rtol=tol, atol=atol)
        assert torch.equal(p.detach(), before)
        lagging = [r for r in range(2, ROWS) if r not in rows]
        if t == 30:   # without catch-up those rows would differ: they do lag before settling
            assert float((before[lagging] - ref[lagging]).abs().max()) > 1e-3

    p, opt = _run(schedule, b1, b2, 0.0, rowwise, check)
    settle_tables([opt])
    torch.testing.assert_close(p.detach(), _brute(schedule, b1, b2, 0.0, rowwise), rtol=tol, atol=atol)
    # row 2 (read at steps 1 and 40) got its 38 missed moves; row 1 (never read) never moved
    torch.manual_seed(0)
    assert torch.equal(p.detach()[1], torch.randn(ROWS, WIDTH, dtype=torch.float64)[1])


def test_catchup_gap_beyond_the_horizon_and_with_eps():
    b1, b2 = 0.9, 0.95
    n = _horizon(b1, b2) + 30        # row 2: read at step 1 and after a gap longer than the horizon
    assert (b1 / math.sqrt(b2)) ** _horizon(b1, b2) < 1e-12
    schedule = _schedule(n)
    p, _ = _run(schedule, b1, b2, 0.0, False)
    torch.testing.assert_close(p.detach()[2], _brute(schedule, b1, b2, 0.0, False)[2], rtol=1e-9, atol=1e-12)
    # eps = 1e-8 (the default) is left out of the missed moves only: a 1e-6 relative difference
    # at gradients of order 1 (sqrt(v) ~ 0.1-1, eps/sqrt(v) <= 1e-7 per move)
    sched = _schedule(40)
    p, opt = _run(sched, b1, b2, 1e-8, False)
    opt.settle()
    torch.testing.assert_close(p.detach(), _brute(sched, b1, b2, 1e-8, False), rtol=1e-6, atol=1e-8)


def test_without_catchup_rows_read_now_and_then_lag_dense_adam():
    """What catch-up repairs: plain lazy Adam moves a row read once per ~4 steps far less."""
    b1, b2 = 0.9, 0.95
    schedule = _schedule(40)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, WIDTH, dtype=torch.float64))
    start = p.detach().clone()
    opt = LazyAdam([p], lr=0.05, betas=(b1, b2), eps=0.0)
    for t, rows in enumerate(schedule, 1):
        p.grad = sparse_row_grad(torch.tensor(rows), _grad(rows, t), p.shape)
        opt.param_groups[0]["lr"] = _lr(t)
        opt.step()
    ref = _brute(schedule, b1, b2, 0.0, False)
    lazy_move = (p.detach() - start)[3:].norm(dim=1)
    dense_move = (ref - start)[3:].norm(dim=1)
    assert float((lazy_move / dense_move).median()) < 0.7


EXTRA = ["schedule.steps=6", "schedule.warmdown_steps=3", "run.checkpoint_every=2",
         "run.val_every=2", "optim.grad_clip_norm=0.5", "optim.memory_catchup=true"]


@pytest.mark.parametrize("mode", ["sparse", "rowwise"])
def test_catchup_training_resumes_bit_identically(tiny_data, tmp_path, mode):
    from test_memory_update import assert_resume_bit_identical
    ref, wa = assert_resume_bit_identical(tiny_data, tmp_path, EXTRA + [f"optim.memory_update={mode}"])
    with single_thread():
        plain = train(tiny_config(tiny_data, "mini-engram", EXTRA[:-1] + [f"optim.memory_update={mode}"]),
                      tmp_path / "plain")
    saved = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert saved["optim"]["memory_catchup"] is True
    # catch-up changed the table (the plain lazy run's final table differs)
    key = next(k for k in wa if k.endswith("memory.table.weight"))
    assert not torch.equal(wa[key], weights(tmp_path / "plain")[key])
    assert plain["val_loss"] != ref["val_loss"]


def test_catchup_config_rules(tiny_data):
    cfg = tiny_config(tiny_data, "mini-engram")
    assert "memory_catchup" not in cfg.to_dict()["optim"]
    with pytest.raises(TngramError, match="optim.memory_catchup=true needs optim.memory_update"):
        tiny_config(tiny_data, "mini-engram", ["optim.memory_catchup=true"])


@pytest.mark.parametrize("name", ["engram", "tngram"])
def test_training_with_catchup_follows_dense_adam(name):
    """A tiny model trained 25 steps (float64, eps 1e-30, rows read now and then): sparse table
    gradients + LazyAdam with catch-up give the weights dense torch Adam gives, to 1e-8 of each
    tensor's largest entry. This needs
    the rows brought up to date when read, before the forward (the read hook); catch-up at the
    update alone leaves each forward reading stale rows and fails this."""
    from test_memory_update import MEMORIES, batch, tiny
    from tngram.optim.memory_update import set_sparse_grads
    lr, betas, eps = 0.02, (0.9, 0.95), 1e-30
    dense, lazy = tiny(MEMORIES[name]).double(), tiny(MEMORIES[name]).double()
    adam = torch.optim.Adam(dense.parameters(), lr=lr, betas=betas, eps=eps)
    tables = set_sparse_grads(lazy)
    ids_t = {id(p) for p in tables}
    opts = [LazyAdam(tables, lr=lr, betas=betas, eps=eps, catchup=True),
            torch.optim.Adam([p for p in lazy.parameters() if id(p) not in ids_t], lr=lr, betas=betas, eps=eps)]
    for step in range(25):
        ids = batch(step, hi=64)
        for model, steppers in ((dense, [adam]), (lazy, opts)):
            model(ids, ids).backward()
            for o in steppers:
                o.step()
            model.zero_grad(set_to_none=True)
    with opts[0].settled():
        for (n, a), b in zip(dense.named_parameters(), lazy.parameters()):
            # float64; the two orders of float sums differ by ~1e-10 of the tensor's scale (without
            # the read hook: 0.1-0.4 of it)
            torch.testing.assert_close(b, a, rtol=0, atol=1e-8 * float(a.detach().abs().max()), msg=n)
    # the tables did move (so the comparison is not between two untouched tables)
    assert float((tables[0].detach() - tiny(MEMORIES[name]).double().state_dict()[
        next(k for k, p in lazy.named_parameters() if p is tables[0])]).abs().max()) > 1e-2


@pytest.mark.parametrize("rowwise", [False, True], ids=["sparse", "rowwise"])
def test_settling_at_read_and_at_the_update_give_the_same_bits(rowwise):
    """Under DDP a row read by one process only is settled there before the forward and on the
    others at the update; the replicas must stay bitwise equal. Two copies of a table get the same
    gradients; one settles each step's rows first (as the read hook does), the other does not."""
    schedule = _schedule(40)
    copies = []
    for read_first in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(ROWS, WIDTH))
        opt = (RowwiseAdam if rowwise else LazyAdam)([p], lr=0.05, betas=(0.9, 0.95), eps=1e-8, catchup=True)
        copies.append((p, opt, read_first))
    for t, rows in enumerate(schedule, 1):
        for p, opt, read_first in copies:
            if read_first:
                opt.settle_rows(p, torch.tensor(rows))
            p.grad = sparse_row_grad(torch.tensor(rows), _grad(rows, t).float(), p.shape)
            opt.param_groups[0]["lr"] = _lr(t)
            opt.step()
        assert torch.equal(copies[0][0], copies[1][0]), t
    assert torch.equal(copies[0][1].state[copies[0][0]]["exp_avg"], copies[1][1].state[copies[1][0]]["exp_avg"])
