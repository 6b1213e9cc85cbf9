"""The kernels section's `inductor` variant (tngram.bench.gpu_kernels.inductor_lookup): the
plain-autograd lookup stage of a copy of the module, compiled by torch.compile, computes what
the module's own fused lookup computes (here the C kernel or the torch path of a CPU run), for
the orders summed and concatenated, with and without RMSNorm and absorption; and it leaves the
module itself as it was."""

import pytest
import torch

from tngram.bench.gpu import shapes_for
from tngram.bench.gpu_kernels import _tngram_module, inductor_lookup


# (recipe, leaves): the paper's (orders concatenated) and -sum have factors, absorption vectors
# and log-scales; -sum-lean no absorption
@pytest.mark.parametrize(
    "recipe, n_leaves",
    [("paper-l9-tngram", 3), ("paper-l9-tngram-sum", 3), ("paper-l9-tngram-sum-lean", 2)],
)
def test_inductor_stage_equals_the_modules_lookup(recipe, n_leaves):
    mod, m = _tngram_module(recipe, shapes_for("cpu"))
    c = mod.config
    assert c.fused  # the module's own path: the fused lookup
    summed = c.order_combine == "sum"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # factors away from their init (ones-like scales, unit absorption)
        for p in (mod.factors, mod.absorb, mod.log_scales):
            if p is not None:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, m.vocab_size, (2, 40), generator=g)
    stage, leaves = inductor_lookup(mod, ids, torch.float32, summed)
    e = stage()
    ref = mod.memory_vector(ids, None, summed)
    assert e.shape == ref.shape == (2, 40, c.cp_rank if summed else (c.max_ngram - 1) * c.cp_rank)
    torch.testing.assert_close(e, ref, rtol=1e-5, atol=1e-6)
    up = torch.randn(e.shape, generator=g)
    mine = [p for p in (mod.factors, mod.absorb, mod.log_scales) if p is not None]
    assert [p.shape for p in leaves] == [p.shape for p in mine] and len(mine) == n_leaves
    assert all(a is not b for a, b in zip(leaves, mine))  # a copy: the module is not touched
    got = torch.autograd.grad(e, leaves, up)
    want = torch.autograd.grad(ref, mine, up)
    # dW / ds are fp32 sums over the 80 tokens in another order: a few ulps of the sum each,
    # 80 * 2^-24 * |terms| ~ 5e-6 here; a missing term or a wrong index is off by O(1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    assert mod.config.fused and all(p.grad is None for p in mine)
