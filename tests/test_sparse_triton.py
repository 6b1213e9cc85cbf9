"""The row-sparse table updates' Triton kernel (tngram.kernels.row_update_triton) and its choice.

Under the Triton interpreter (a subprocess with TRITON_INTERPRET=1 and the kernel forced by
TNGRAM_ROW_UPDATE_IMPL=triton) LazyAdam and RowwiseAdam, with and without catch-up, fp32 and
bf16 tables, take the same steps through the kernel as through the torch path: gradients with
duplicate rows (coalesced, summed), rows never touched (weights and every state tensor stay
bit-identical), rows settled before a read (the catch-up read hook), and a tiny GPT trained with
the read hook on. Tolerance, per tensor after K steps: K * (2 + extra) ulps of its largest
entry (ulp: 2^-23 fp32, 2^-7 bf16 relative). Why: the kernel does torch's operations in torch's
order with the same roundings (FMA where torch's add_/addcmul_ round once, the host scalar's
division as on the device), so one step can differ only by a double rounding of one
intermediate (1 ulp, measured: a few entries in a hundred) or, for rowwise, by the order of the
sum of W squares (at most 2 W ulps of v, W ulps of the move: extra = W); each step's difference
is carried on at most once per later step (decays b1, b2 < 1 shrink it). Measured here: fp32
LazyAdam/RowwiseAdam within 1 ulp, bf16 within 1 ulp of a few entries.

The same subprocess runs the first-use self-check (against float64): it passes the kernel and
fails a kernel that drops the catch-up or updates the wrong rows.

In-process: the kernel lowers to a cubin for sm_80 without a GPU; "auto" keeps torch on CPU,
and on CUDA when the self-check fails (one warning line); a kernel raising
mid-training falls back to torch with one warning and the torch numbers; and no step on the
sparse path touches a table but through row-indexed ops (Engram, TN-gram, and the hashed
hybrid's two tables; a dispatch-mode audit that flags the dense path's whole-table gradient, so
it would catch one).
"""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from triton_subprocess import Case, assert_lowers_to_sm80_cubin, run_under_interpreter

from tngram.kernels import row_update as ru
from tngram.kernels.choice import triton_available
from tngram.kernels.sparse_rows import sparse_row_grad
from tngram.memory.engram import EngramConfig
from tngram.memory.tngram import TNGramConfig
from tngram.memory.tngram_variants import TNGramVariantConfig
from tngram.model.gpt import GPT, GPTConfig
from tngram.optim import lazy_rows
from tngram.optim.groups import memory_table_params
from tngram.optim.memory_update import LazyAdam, RowwiseAdam, clip_grad_norm, set_sparse_grads

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

SCRIPT = textwrap.dedent("""
    import json, os, torch
    from tngram.optim.memory_update import LazyAdam, RowwiseAdam, set_sparse_grads
    from tngram.memory.engram import EngramConfig
    from tngram.memory.tngram import TNGramConfig
    from tngram.model.gpt import GPT, GPTConfig
    SHAPE = (3, 20, 6)                      # a TN-gram-like (N, V, R) table: 60 rows of width 6
    NROWS, K = 60, 5

    def grad(step, dtype):              # 12 ids (duplicates) among the first 30 rows, uncoalesced
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, NROWS // 2, (12,), generator=g)
        idx = torch.stack(torch.unravel_index(ids, SHAPE[:-1]))
        vals = torch.randn(12, SHAPE[-1], generator=g).to(dtype)
        return torch.sparse_coo_tensor(idx, vals, SHAPE, check_invariants=False)

    def run(impl, cls, catchup, dtype):
        os.environ["TNGRAM_ROW_UPDATE_IMPL"] = impl
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(SHAPE).to(dtype))
        opt = cls([w], lr=0.05, betas=(0.9, 0.95), eps=1e-8, catchup=catchup)
        for t in range(K):
            w.grad = grad(t, dtype)
            opt.step()
            if catchup and t % 2 == 1:      # rows 0, 3, ..., 27 settled as before a read
                opt.settle_rows(w, torch.arange(0, NROWS // 2, 3))
        st = {k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)}
        return {"w": w.detach().clone(), **{k: v for k, v in st.items() if k != "lr_history"}}

    def diff(a, b):
        d = (a.double() - b.double()).abs()
        return [d.max().item(), a.double().abs().max().item(), int((a != b).sum())]

    out = {"opt": {}, "model": {}}
    for cls in (LazyAdam, RowwiseAdam):
        for catchup in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                ref, got = run("torch", cls, catchup, dtype), run("triton", cls, catchup, dtype)
                torch.manual_seed(0)
                init = torch.randn(SHAPE).to(dtype).view(NROWS, -1)
                untouched = {"w": bool(torch.equal(got["w"].view(NROWS, -1)[30:], init[30:]))}
                for k in ref:
                    x = got[k].view(NROWS, -1) if got[k].dim() > 1 else got[k]
                    untouched[k + "_untouched_zero"] = (k == "w" or not bool(x[30:].any()))
                key = f"{cls.__name__}/{catchup}/{str(dtype)[6:]}"
                out["opt"][key] = {"diff": {k: diff(got[k], ref[k]) for k in ref},
                                   "untouched": untouched}

    def tiny(mem):
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=48, n_layer=1, n_embd=16, n_head=2, n_kv_head=1,
                             sequence_len=8, memory=mem, memory_layers=(0,), memory_seed=0))

    mems = {"tngram": TNGramConfig(max_ngram=3, cp_rank=8),
            "engram": EngramConfig(max_ngram=2, n_head_per_ngram=2, pad_id=0)}
    for name, mem in mems.items():
        finals = {}
        for impl in ("torch", "triton"):
            os.environ["TNGRAM_ROW_UPDATE_IMPL"] = impl
            model = tiny(mem)
            tables = set_sparse_grads(model)
            opt = LazyAdam(tables, lr=0.02, betas=(0.9, 0.95), eps=1e-8, catchup=True)
            for step in range(4):
                ids = torch.randint(0, 48, (1, 8), generator=torch.Generator().manual_seed(step))
                model(ids, ids).backward()  # the forward's read hook settles the rows it reads
                opt.step()
                model.zero_grad(set_to_none=True)
            finals[impl] = tables[0].detach().clone()
        out["model"][name] = diff(finals["triton"], finals["torch"])

    from tngram.kernels import row_update as ru   # the self-check: the kernel, then wrong ones
    out["check"] = {"kernel": ru.row_self_check("cpu", torch.float32)}
    real = ru.row_update
    def no_catchup(*a, **kw):
        real(*a, **{**kw, "catchup": None})
    def wrong_rows(w, m, v, rows, grad, **kw):
        real(w, m, v, (rows + 1) % w.shape[0], grad, **kw)
    for bad in (no_catchup, wrong_rows):
        ru.row_update = bad
        out["check"][bad.__name__] = ru.row_self_check("cpu", torch.float32)
    print(json.dumps(out))
""")

ULP = {"float32": 2.0**-23, "bfloat16": 2.0**-7}
K = 5


@needs_triton
def test_row_kernel_takes_the_torch_paths_steps_under_the_interpreter():
    lines = run_under_interpreter(SCRIPT)
    res = json.loads(lines[-1])
    assert len(res["opt"]) == 8
    for key, r in res["opt"].items():
        cls, _, dtype = key.split("/")
        extra = 6 if cls == "RowwiseAdam" else 0  # W = 6: the rowwise sum's order
        for name, (err, scale, _) in r["diff"].items():
            tol = K * (2 + extra) * ULP[dtype] * scale
            assert err <= tol, (key, name, err, tol)
        assert all(r["untouched"].values()), (key, r["untouched"])
        # the kernel is not a copy of the weights: the touched rows moved
        assert r["diff"]["w"][1] > 0
    for name, (err, scale, _) in res["model"].items():
        assert err <= 4 * 2 * ULP["float32"] * scale, (name, err, scale)
    # the self-check against float64 passes the kernel and fails a kernel that drops the
    # catch-up or updates the wrong rows (by O(1), against a tolerance of 1e-5)
    check = res["check"]
    assert check["kernel"]["passed"] and check["kernel"]["max_rel_err"] < 1e-6, check["kernel"]
    for bad in ("no_catchup", "wrong_rows"):
        assert not check[bad]["passed"] and check[bad]["max_rel_err"] > 1e-3, check[bad]


def row_kernel_cases() -> list[Case]:
    """(table dtype, rowwise, step, mark): the step with catch-up; settling before a read."""
    cases: list[Case] = []
    for dt, rowwise, step, mark in (("fp32", False, True, 1), ("bf16", True, True, 1),
                                    ("fp32", False, False, 2)):
        ptr = {"w_ptr": "*" + dt, "m_ptr": "*" + dt, "v_ptr": "*fp32" if rowwise else "*" + dt,
               "rows_ptr": "*i64", "g_ptr": "*" + dt, "last_ptr": "*i32", "f_ptr": "*" + dt,
               "d1_ptr": "*" + dt, "d2_ptr": "*fp32" if rowwise else "*" + dt}
        sig = {**ptr, "U": "i32", "W": "i32", "t_mark": "i32",
               **{n: "fp32" for n in ("b1", "a1", "b2", "a2", "c_step", "bc2", "inv_w", "w_f")},
               "eps": "fp32"}
        const = {"ROWWISE": rowwise, "STEP": step, "CATCHUP": True, "MARK": mark, "RECIP": True,
                 "BLOCK_U": 32, "BLOCK_W": 64}
        cases.append(("_row_adam_kernel", sig, const))
    return cases


@needs_triton
def test_row_kernel_compiles_for_cuda_without_a_gpu():
    """The interpreter accepts code the GPU compiler rejects: the kernel is also lowered to a
    cubin for sm_80 (triton's bundled ptxas): fp32 LazyAdam and bf16 RowwiseAdam steps with
    catch-up, and the settling before a read (no step, last steps marked where stepped)."""
    assert_lowers_to_sm80_cubin("tngram.kernels.row_update_triton", row_kernel_cases())


def test_auto_keeps_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("TNGRAM_ROW_UPDATE_IMPL", raising=False)
    ru.reset_row_choices()
    assert ru.row_update_impl(torch.device("cpu"), torch.float32) == "torch"
    monkeypatch.setenv("TNGRAM_ROW_UPDATE_IMPL", "gpu-please")
    with pytest.raises(ValueError, match="TNGRAM_ROW_UPDATE_IMPL"):
        ru.row_update_impl(torch.device("cpu"), torch.float32)


def test_a_kernel_that_raises_falls_back_to_torch_with_one_warning(monkeypatch):
    """ "auto" chose the kernel (as on CUDA after its self-check); the kernel raises at the first
    step: one warning, the step and every later one are torch's, and the numbers are torch's."""
    monkeypatch.delenv("TNGRAM_ROW_UPDATE_IMPL", raising=False)
    shape = (30, 5)

    def train(opt_cls, catchup):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(shape))
        opt = opt_cls([w], lr=0.05, betas=(0.9, 0.95), eps=1e-8, catchup=catchup)
        for t in range(3):
            rows = torch.tensor([t, 3 + t, 7])
            w.grad = sparse_row_grad(rows, torch.randn(3, shape[1]), shape)
            opt.step()
        return w.detach().clone()

    for cls in (LazyAdam, RowwiseAdam):
        ru.reset_row_choices()
        ref = train(cls, True)
        calls = []

        def boom(*a, **kw):
            calls.append(1)
            raise RuntimeError("no kernel image is available\nsecond line")

        ru._CHOICE[("cpu", "torch.float32")] = ("triton", "")
        monkeypatch.setattr(lazy_rows, "row_update", boom)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(cls, True)
        monkeypatch.undo()
        monkeypatch.delenv("TNGRAM_ROW_UPDATE_IMPL", raising=False)
        lines = [str(c.message) for c in caught if "row-update kernel" in str(c.message)]
        assert len(calls) == 1 and len(lines) == 1, (calls, lines)
        assert "RuntimeError: no kernel image is available; using torch" in lines[0]
        assert "\n" not in lines[0]
        assert torch.equal(got, ref)
    ru.reset_row_choices()


class _TableAudit(TorchDispatchMode):
    """Records every aten op that reads or writes a table's (or its optimiser state's) storage,
    and every op that makes a dense tensor of a table's shape."""

    def __init__(self, storages: set[int], shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.storages, self.shapes, self.ops = storages, shapes, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.layout == torch.strided
                and (
                    t.untyped_storage().data_ptr() in self.storages or tuple(t.shape) in self.shapes
                )
            ):
                self.ops.add(func.__name__.split(".")[0])
        return out


ROW_OPS = {
    "index_select",
    "index_add_",
    "index_copy_",
    "index_fill_",
    "view",
    "_unsafe_view",
    "reshape",
    "alias",
    "detach",
    "embedding",
}


def _audited_steps(mem, vocab: int, cls, sparse: bool) -> tuple[set[str], tuple[int, ...]]:
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=vocab,
            n_layer=1,
            n_embd=32,
            n_head=4,
            n_kv_head=2,
            sequence_len=16,
            memory=mem,
            memory_layers=(0,),
            memory_seed=0,
        )
    )
    tables = set_sparse_grads(model, True) if sparse else memory_table_params(model)
    opt = cls(tables, lr=0.01, betas=(0.9, 0.95), eps=1e-8, catchup=sparse)

    def step(seed: int) -> None:
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(ids, ids).backward()
        clip_grad_norm(tables, 1.0)
        opt.step()
        model.zero_grad(set_to_none=True)

    step(0)  # the first step allocates the state (once per run, O(table) by nature)
    watched = list(tables)
    for t in tables:
        watched += [v for k, v in opt.state[t].items() if torch.is_tensor(v) and k != "lr_history"]
    audit = _TableAudit(
        {t.untyped_storage().data_ptr() for t in watched}, {tuple(t.shape) for t in tables}
    )
    with audit:
        step(1)
        step(2)
    return audit.ops, tuple(tables[0].shape)


@pytest.mark.parametrize("name", ["engram", "tngram", "tngram-hsum"])
def test_no_step_on_the_sparse_path_touches_the_whole_table(name):
    """Forward, backward, clip and the optimiser step with catch-up (the read hook included)
    touch the table and its state only through row-indexed ops; nothing of the table's shape
    is made (no dense gradient, zero-fill or to_dense). Control: the same audit flags a dense
    table gradient."""
    if name == "engram":
        mem, vocab = (
            EngramConfig(max_ngram=3, n_head_per_ngram=2, pad_id=0, table_budget=(50021, 50023)),
            64,
        )
        cls = LazyAdam
    elif name == "tngram":
        mem, vocab, cls = TNGramConfig(max_ngram=3, cp_rank=8), 4099, RowwiseAdam
    else:  # the factors and the hashed orders' table, both row-sparse
        mem = TNGramVariantConfig(
            max_ngram=3,
            cp_rank=8,
            order_combine="sum",
            hash_orders=(2, 3),
            hash_embed=8,
            hash_heads=2,
            hash_budget=20011,
        )
        vocab, cls = 4099, LazyAdam
    ops, shape = _audited_steps(mem, vocab, cls, sparse=True)
    assert ops and ops <= ROW_OPS, (shape, sorted(ops - ROW_OPS))
    if name == "engram":
        dense_ops, _ = _audited_steps(mem, vocab, cls, sparse=False)
        assert dense_ops - ROW_OPS, sorted(dense_ops)


@needs_triton
def test_auto_on_cuda_falls_back_in_one_line_when_the_self_check_fails(monkeypatch):
    """ "auto" on a CUDA table runs the self-check first; where it cannot pass (here: no GPU, the
    check's tensors cannot reach the device) it warns once, in one line, and keeps torch; the
    record says why and sits with the lookup's self-checks (env.json, tngram doctor)."""
    from tngram.kernels import self_check_results

    monkeypatch.delenv("TNGRAM_ROW_UPDATE_IMPL", raising=False)
    ru.reset_row_choices()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ru.row_update_impl(torch.device("cuda"), torch.float32) == "torch"
            assert ru.row_update_impl(torch.device("cuda"), torch.float32) == "torch"  # cached
        lines = [str(c.message) for c in caught if "row-update kernel" in str(c.message)]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert "failed its self-check on cuda float32" in lines[0] and "using torch" in lines[0]
        rec = self_check_results()["row_update/float32"]
        assert rec["passed"] is False and rec["error"]
        assert ru.resolved_row_impl("cuda").startswith("torch (row-update kernel failed")
    finally:
        ru.reset_row_choices()
