"""The first-use self-check of compiled lookups (tngram.kernels.choice): a kernel that disagrees
with the plain torch computation, in the forward or only in the backward, or that raises, is
replaced by the torch path with one warning, and the outcome is recorded (env.json, doctor)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tngram.kernels.choice as choice
from tngram.kernels import c_unavailable_reason, fused_lookup, resolved_impl, self_check_results
from tngram.kernels.tngram_c import c_lookup
from tngram.memory.ngrams import suffix_ngrams

pytestmark = pytest.mark.skipif(c_unavailable_reason() is not None,
                                reason=f"C kernel unavailable: {c_unavailable_reason()}")



def small():
    g = torch.Generator().manual_seed(3)
    f = torch.randn(4, 9, 16, generator=g).requires_grad_()
    a = torch.randn(2, 16, generator=g).requires_grad_()
    ls = torch.zeros(3).requires_grad_()
    return f, a, ls, suffix_ngrams(torch.randint(0, 9, (2, 7), generator=g), 4, 0)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, backward x 1.001: a kernel whose gradient alone is wrong."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g * 1.001


WRONG = {
    "forward": lambda *a: c_lookup(*a) * 1.001,              # 1e-3 relative > tolerance 1e-4
    "backward": lambda *a: _ScaleGrad.apply(c_lookup(*a)),
    "raises": lambda *a: (_ for _ in ()).throw(RuntimeError("illegal memory access")),
}


def test_the_c_kernel_passes_its_self_check_and_is_chosen(fresh_lookup_choice):
    f, a, ls, ng = small()
    fused_lookup(f, a, ls, ng)
    rec = self_check_results()["c/float32"]
    # the kernel's known fp32 error is < 2e-5 of the largest magnitude (test_fused_lookup.py)
    assert rec["passed"] and rec["error"] is None and 0 <= rec["max_rel_err"] < 2e-5
    assert rec["tolerance"] == 1e-4 and resolved_impl("cpu") == "c"


@pytest.mark.parametrize("how", list(WRONG))
def test_a_wrong_kernel_falls_back_to_torch_with_one_warning(fresh_lookup_choice, how):
    fresh_lookup_choice.setitem(choice.IMPL_FNS, "c", WRONG[how])
    f, a, ls, ng = small()
    with pytest.warns(RuntimeWarning, match="c kernel failed its self-check on cpu float32"):
        e = fused_lookup(f, a, ls, ng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # the second call must not warn again
        e2 = fused_lookup(f, a, ls, ng)
    ref = fused_lookup(f, a, ls, ng, impl="torch")
    assert torch.equal(e, ref) and torch.equal(e2, ref)
    rec = self_check_results()["c/float32"]
    assert not rec["passed"]
    if how == "raises":
        assert "illegal memory access" in rec["error"]
    else:   # the injected error is 1e-3 of a value: measured between 1e-4 and 1e-2
        assert 1e-4 < rec["max_rel_err"] < 1e-2
    assert resolved_impl("cpu").startswith("torch (c kernel failed its self-check")


def test_forced_impl_skips_the_check_and_env_json_records_it(fresh_lookup_choice):
    from tngram.train.metrics import env_info
    fresh_lookup_choice.setitem(choice.IMPL_FNS, "c", WRONG["forward"])
    fresh_lookup_choice.setenv("TNGRAM_LOOKUP_IMPL", "c")
    f, a, ls, ng = small()
    ref = fused_lookup(f, a, ls, ng, impl="torch")
    assert not torch.allclose(fused_lookup(f, a, ls, ng), ref)     # forced: no check, no fallback
    assert self_check_results() == {}
    fresh_lookup_choice.delenv("TNGRAM_LOOKUP_IMPL")
    with pytest.warns(RuntimeWarning):
        info = env_info(torch.device("cpu"), 1, 1)
    assert info["tngram_lookup_impl"].startswith("torch (c kernel failed")
    assert info["lookup_self_checks"]["c/float32"]["passed"] is False
