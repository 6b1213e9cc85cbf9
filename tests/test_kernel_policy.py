"""tngram.kernels.policy: kernel and dtype choices are made in one place, set by a context manager,
and every setting computes the same thing."""

from __future__ import annotations

import pytest
import torch

from tngram.kernels import current_policy, kernel_policy
from tngram.memory.gating import GatedFusion
from tngram.memory.tngram import TNGramConfig


def test_policy_is_scoped_and_checked():
    before = current_policy()
    with kernel_policy(fuse_kv=False, fuse_kv_min_rows=1) as p:
        assert current_policy() is p and not p.fuse_kv and p.fuse_kv_min_rows == 1
    assert current_policy() == before and before.fuse_kv and before.fuse_kv_min_rows == 64
    with pytest.raises(ValueError, match="lookup_impl"):
        with kernel_policy(lookup_impl="cuda-please"):
            pass
    assert current_policy() == before


@pytest.mark.parametrize("rows", [3, 80])          # below and above fuse_kv_min_rows
def test_fused_and_separate_kv_give_the_same_output_and_gradients(rows):
    torch.manual_seed(0)
    g = GatedFusion(12, 16, kernel_size=3, zero_init_value=False, zero_init_conv=False)
    e = torch.randn(1, rows, 12)
    h = torch.randn(1, rows, 16)
    out = {}
    for fuse in (True, False):
        g.zero_grad(set_to_none=True)
        with kernel_policy(fuse_kv=fuse):
            y = g(h, e)
        y.square().sum().backward()
        out[fuse] = (y.detach(), {n: p.grad.clone() for n, p in g.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    for n, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], grad, rtol=1e-5, atol=1e-6)


def test_lookup_impl_from_the_policy_runs_that_kernel(monkeypatch):
    from tngram.kernels import choice
    torch.manual_seed(0)
    m = TNGramConfig(max_ngram=3, cp_rank=8).build(d_model=16, vocab_size=30)
    ids = torch.randint(0, 30, (2, 9))
    ref = m.memory_vector(ids)
    ran = []
    for name, fn in list(choice.IMPL_FNS.items()):
        monkeypatch.setitem(choice.IMPL_FNS, name, lambda *a, _n=name, _f=fn, **k: ran.append(_n) or _f(*a, **k))
    with kernel_policy(lookup_impl="torch"):
        got = m.memory_vector(ids)
    assert ran == ["torch"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
