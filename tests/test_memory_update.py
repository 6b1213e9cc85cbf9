"""optim.memory_update = sparse | rowwise: row-sparse table gradients and the updates that use them.

Each check is against an independent computation:
- the sparse gradient of every table (Engram, Over-Encoding, TN-gram through the torch and the C
  lookup) holds exactly the distinct rows the batch reads, with the dense gradient's values;
- LazyAdam (optim.memory_update=sparse) on those gradients equals a hand-written lazy Adam
  (float64, per row), torch.optim.SparseAdam, and on rows touched at every step
  torch.optim.Adam (the two differ only in where eps sits);
- RowwiseAdam equals a per-row Python loop of its formula, and its state is <= 5 bytes/param;
- clip_grad_norm with sparse gradients equals torch's clip on the densified gradients;
- a tiny sparse training run resumes bit-identically, and compiles (graph break around the
  compaction) to the eager gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_train_support import losses, single_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.kernels import c_unavailable_reason, fused_lookup
from tngram.memory.engram import EngramConfig
from tngram.memory.overencoding import OverEncodingConfig
from tngram.memory.tngram import TNGramConfig
from tngram.model.gpt import GPT, GPTConfig
from tngram.optim.memory_update import (LazyAdam, RowwiseAdam, clip_grad_norm,
                                        optimizer_state_bytes, set_sparse_grads)
from tngram.train.loop import train

V = 64
MEMORIES = {"engram": EngramConfig(max_ngram=3, n_head_per_ngram=2, pad_id=0),
            "tngram": TNGramConfig(max_ngram=3, cp_rank=8),
            "oe": OverEncodingConfig(table_rows=97)}


def tiny(memory) -> GPT:  # noqa: ANN001
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, sequence_len=16,
                         memory=memory, memory_layers=(1,), memory_seed=0))


def batch(seed: int, hi: int = V) -> torch.Tensor:
    return torch.randint(0, hi, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MEMORIES))
def test_sparse_table_gradient_is_the_touched_rows_of_the_dense_one(name):
    dense, sparse = tiny(MEMORIES[name]), tiny(MEMORIES[name])
    tables = set_sparse_grads(sparse)
    assert len(tables) == 1
    ids = batch(1)
    for m in (dense, sparse):
        m(ids, ids).backward()
    for (n, pd), ps in zip(dense.named_parameters(), sparse.parameters()):
        if ps is tables[0]:
            g = ps.grad.coalesce()
            assert ps.grad.is_sparse
            rows = (g.indices()[0] if g.indices().shape[0] == 1 else
                    g.indices()[0] * ps.shape[1] + g.indices()[1])
            touched = pd.grad.reshape(-1, ps.shape[-1]).ne(0).any(1).nonzero().flatten()
            # every touched row is there (an all-zero row can only be an extra, never missing)
            assert set(touched.tolist()) <= set(rows.tolist())
            assert g.indices().shape[1] < ps.numel() // ps.shape[-1]     # far fewer than all rows
            torch.testing.assert_close(g.to_dense(), pd.grad, rtol=0, atol=0)
        else:
            torch.testing.assert_close(ps.grad, pd.grad, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("impl", ["torch", pytest.param("c", marks=pytest.mark.skipif(
    c_unavailable_reason() is not None, reason="no C kernel"))])
def test_fused_lookup_sparse_grad_equals_dense_per_kernel(impl):
    torch.manual_seed(0)
    N, Vf, R = 4, 50, 16
    f = torch.randn(N, Vf, R, requires_grad=True)
    a = (torch.rand(N - 2, R) + 0.5).requires_grad_()
    s = torch.zeros(N - 1, requires_grad=True)
    ng = torch.randint(0, Vf, (2, 7, N), generator=torch.Generator().manual_seed(3))
    e1 = fused_lookup(f, a, s, ng, impl=impl)
    g = torch.randn_like(e1)
    d1 = torch.autograd.grad((e1 * g).sum(), [f, a, s])
    e2 = fused_lookup(f, a, s, ng, impl=impl, sparse_grad=True)
    d2 = torch.autograd.grad((e2 * g).sum(), [f, a, s])
    assert torch.equal(e1, e2)
    assert d2[0].is_sparse
    # distinct (factor, token) pairs read: column k of ngrams reads factor N-1-k
    pairs = {(N - 1 - k, int(t)) for k in range(N) for t in ng[..., k].flatten()}
    assert d2[0]._nnz() == len(pairs)
    torch.testing.assert_close(d2[0].to_dense(), d1[0], rtol=0, atol=0)
    torch.testing.assert_close(d2[1], d1[1], rtol=0, atol=0)
    torch.testing.assert_close(d2[2], d1[2], rtol=0, atol=0)


def _table_steps(seed_batches, make_opt, rows=40, width=6, always=None):
    """Run an optimiser on a (rows, width) table with sparse gradients of a fixed quadratic loss
    on the rows of each batch; returns the weights after each step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(rows, width))
    target = torch.randn(rows, width)
    opt = make_opt([w])
    out = []
    for b in seed_batches:
        from tngram.kernels.sparse_rows import compact_rows
        sub, inv = compact_rows(w, b)
        loss = ((sub[inv] - target[b]) ** 2).sum() * 0.5
        loss.backward()
        opt.step()
        w.grad = None
        out.append(w.detach().clone())
    return w, target, out


def _batches(n_steps=6, rows=40, always=(0, 1, 2)):
    g = torch.Generator().manual_seed(7)
    return [torch.cat([torch.tensor(always), torch.randint(3, rows, (5,), generator=g)])
            for _ in range(n_steps)]


def test_sparse_adam_is_lazy_adam():
    lr, b1, b2, eps = 0.05, 0.9, 0.95, 1e-8
    batches = _batches()
    _, target, got = _table_steps(batches, lambda p: LazyAdam(p, lr=lr, betas=(b1, b2), eps=eps))
    # optim.memory_update=sparse runs LazyAdam: torch.optim.SparseAdam's numbers, faster
    _, _, torch_sparse = _table_steps(batches, lambda p: torch.optim.SparseAdam(
        p, lr=lr, betas=(b1, b2), eps=eps))
    for a, b in zip(got, torch_sparse):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # hand-written lazy Adam, float64, row by row (torch's SparseAdam bias correction: the
    # table's step count; the update lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps))
    torch.manual_seed(0)
    w = torch.randn(40, 6).double()
    tgt = target.double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, b in enumerate(batches, 1):
        grad = {}
        for r in b.tolist():                       # duplicate rows add up
            grad[r] = grad.get(r, 0) + (w[r] - tgt[r])
        for r, g in grad.items():
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * g * g
            w[r] = w[r] - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[r] / (v[r].sqrt() + eps)
        untouched = [r for r in range(40) if r not in grad]
        torch.testing.assert_close(got[t - 1].double()[untouched], w[untouched], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[t - 1].double(), w, rtol=0, atol=1e-5)
    # rows 0-2 had a gradient at every step: there lazy Adam is Adam
    torch.manual_seed(0)
    wd = torch.nn.Parameter(torch.randn(40, 6))
    adam = torch.optim.Adam([wd], lr=lr, betas=(b1, b2), eps=eps)
    for b in batches:
        ((wd[b] - target[b]) ** 2).sum().mul(0.5).backward()
        adam.step()
        wd.grad = None
    torch.testing.assert_close(got[-1][:3], wd.detach()[:3], rtol=0, atol=1e-5)
    torch.manual_seed(0)
    assert float((got[-1][:3] - torch.randn(40, 6)[:3]).abs().max()) > 0.1   # the rows did move


def test_rowwise_adam_matches_its_formula_row_by_row_and_state_is_small():
    lr, b1, b2, eps = 0.05, 0.9, 0.95, 1e-8
    batches = _batches()
    w_opt, target, got = _table_steps(batches, lambda p: RowwiseAdam(p, lr=lr, betas=(b1, b2), eps=eps))
    torch.manual_seed(0)
    w = torch.randn(40, 6).double()
    tgt = target.double()
    m, v = torch.zeros_like(w), torch.zeros(40, dtype=torch.float64)
    for t, b in enumerate(batches, 1):
        grad = {}
        for r in b.tolist():
            grad[r] = grad.get(r, 0) + (w[r] - tgt[r])
        for r, g in grad.items():
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * float((g * g).mean())
            w[r] = w[r] - lr / (1 - b1 ** t) * m[r] / (math.sqrt(v[r] / (1 - b2 ** t)) + eps)
        torch.testing.assert_close(got[t - 1].double(), w, rtol=0, atol=1e-5)
    # a dense gradient touches every row: the same formula on all rows
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 8))
    opt = RowwiseAdam([p], lr=lr, betas=(b1, b2), eps=eps)
    g = torch.randn(5, 8)
    p.grad = g.clone()
    before = p.detach().clone()
    opt.step()
    vr = (1 - b2) * g.square().mean(1, keepdim=True)
    expect = before - lr / (1 - b1) * ((1 - b1) * g) / ((vr / (1 - b2)).sqrt() + eps)
    torch.testing.assert_close(p.detach(), expect, rtol=1e-6, atol=1e-7)
    # state: exp_avg (4 B/param) + one fp32 per row (4/width B/param); width 8 -> 4.5 B/param
    assert optimizer_state_bytes(opt) == 5 * 8 * 4 + 5 * 4
    assert optimizer_state_bytes(opt) / p.numel() <= 5


def test_clip_grad_norm_with_sparse_gradients_equals_torch_on_dense():
    from tngram.kernels.sparse_rows import sparse_row_grad
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(10, 4)), torch.nn.Parameter(torch.randn(3, 5, 4))
    a.grad = torch.randn(10, 4)
    rows = torch.tensor([1, 4, 9, 12])
    vals = torch.randn(4, 4)
    # two accumulated micro-steps: an uncoalesced gradient with a repeated row
    b.grad = sparse_row_grad(rows, vals, b.shape) + sparse_row_grad(rows[:2], vals[:2], b.shape)
    dense_b = b.grad.to_dense()
    ad, bd = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    ad.grad, bd.grad = a.grad.clone(), dense_b.clone()
    n_ref = torch.nn.utils.clip_grad_norm_([ad, bd], 1.0)
    n = clip_grad_norm([a, b], 1.0)
    torch.testing.assert_close(n, n_ref)
    assert float(n_ref) > 1.0                                  # clipping did happen
    torch.testing.assert_close(a.grad, ad.grad)
    torch.testing.assert_close(b.grad.to_dense(), bd.grad)


def test_clip_grad_norm_without_sparse_is_torchs():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(7, 3)) for _ in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        p.grad = torch.randn(7, 3) * 3
        q.grad = p.grad.clone()
    assert torch.equal(clip_grad_norm(ps, 0.5), torch.nn.utils.clip_grad_norm_(qs, 0.5))
    for p, q in zip(ps, qs):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("name", ["engram", "tngram"])
def test_compiled_model_gets_the_eager_sparse_gradients(name):
    m = tiny(MEMORIES[name])
    tables = set_sparse_grads(m)
    ids = batch(2)
    m(ids, ids).backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    torch.compile(m, backend="aot_eager")(ids, ids).backward()
    assert tables[0].grad.is_sparse
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad.to_dense(), ref[n].to_dense(), rtol=1e-5, atol=1e-6, msg=n)


EXTRA = ["schedule.steps=6", "schedule.warmdown_steps=3", "run.checkpoint_every=2",
         "run.val_every=0", "optim.grad_clip_norm=0.5"]


def assert_resume_bit_identical(data, tmp_path, sets: list[str]) -> tuple[dict, dict]:  # noqa: ANN001
    """mini-engram with `sets`: trained through, and cut after step 3 then resumed, give the same
    losses, final weights and val loss bit for bit; returns (summary, final weights) of the first."""
    cfg = tiny_config(data, "mini-engram", sets)
    with single_thread():
        ref = train(cfg, tmp_path / "ref")
        train(cfg, tmp_path / "cut", max_steps=3)
        again = train(cfg, tmp_path / "cut", resume=True)
    assert losses(tmp_path / "ref") == losses(tmp_path / "cut")
    wa, wb = weights(tmp_path / "ref"), weights(tmp_path / "cut")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert again["val_loss"] == ref["val_loss"]
    return ref, wa


@pytest.mark.parametrize("mode", ["sparse", "rowwise"])
def test_sparse_training_resumes_bit_identically(tiny_data, tmp_path, mode):
    assert_resume_bit_identical(tiny_data, tmp_path, EXTRA + [f"optim.memory_update={mode}"])
    import json
    saved = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert saved["optim"]["memory_update"] == mode


def test_dense_config_json_has_no_memory_update_key(tiny_data):
    cfg = tiny_config(tiny_data, "mini-engram")
    assert cfg.optim.memory_update == "dense" and "memory_update" not in cfg.to_dict()["optim"]


def test_sparse_lookup_training_moves_only_touched_rows(tiny_data, tmp_path):
    """Two sparse steps (the first has a zero table gradient: Engram's value projection starts
    at 0): rows no token read keep their initial value, read rows move."""
    cfg = tiny_config(tiny_data, "mini-engram", ["schedule.steps=2", "schedule.warmdown_steps=0",
                                                 "run.checkpoint_every=0", "run.val_every=0",
                                                 "optim.memory_update=sparse"])
    with single_thread():
        train(cfg, tmp_path)
    torch.manual_seed(cfg.run.seed)
    init = GPT(cfg.model).state_dict()
    w = weights(tmp_path)
    key = next(k for k in w if k.endswith("memory.table.weight"))
    changed = (w[key] != init[key]).any(1)
    assert 0 < int(changed.sum()) < changed.numel() // 2


def test_hf_model_memory_gets_sparse_grads_and_the_param_group_helper_still_splits():
    """tngram.hf: a memory on a transformers model, set_sparse_grads, the HF param-group helper
    (memory_param_groups) feeding LazyAdam (tables) and AdamW (the rest): the table gradient is
    row-sparse with the dense gradient's values, and a few steps lower the loss."""
    pytest.importorskip("transformers")
    from hf_tiny import VOCAB, tiny_model
    from tngram.hf import add_memory
    from tngram.optim.groups import memory_param_groups
    cfg = TNGramConfig(max_ngram=3, cp_rank=8, zero_init_value=False, zero_init_conv=False)
    dense = add_memory(tiny_model("llama", seed=0).train(), cfg, layers=[1])
    model = add_memory(tiny_model("llama", seed=0).train(), cfg, layers=[1])
    tables = set_sparse_grads(model)
    groups = memory_param_groups(model, table_lr=0.05)
    assert [g["group"] for g in groups] == ["memory_table", "rest"]
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in tables}
    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    dense(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    dense_tables = [p for n, p in dense.named_parameters() if n.endswith("factors")]
    assert tables[0].grad.is_sparse
    torch.testing.assert_close(tables[0].grad.to_dense(), dense_tables[0].grad, rtol=1e-6, atol=1e-7)
    model.zero_grad(set_to_none=True)
    opts = [LazyAdam(groups[0]["params"], lr=groups[0]["lr"]), torch.optim.AdamW(groups[1]["params"], lr=1e-2)]
    first = None
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        for o in opts:
            o.step()
        model.zero_grad(set_to_none=True)
        first = float(loss.detach()) if first is None else first
    assert float(loss.detach()) < first - 0.05
