"""The kernels section's items, in process (research.bench.gpu_kernels; the section itself runs
under the Triton interpreter in tests/test_bench_gpu.py):

- `inductor_lookup`: the plain-autograd lookup stage of a copy of the module, compiled by
  torch.compile, computes what the module's own fused lookup computes (here the C kernel or the
  torch path of a CPU run), for the orders summed and concatenated, with and without RMSNorm
  and absorption; and it leaves the module itself as it was.
- `row_grad_adds`: the rows it adds are the lookup's factor rows (a case worked by hand), the
  atomic and sorted sums agree, and `zipf_ids` draws from the law it names.
"""

import pytest
import torch

from research.bench.gpu import shapes_for
from research.bench.gpu_kernels import _tngram_module, inductor_lookup, row_grad_adds, zipf_ids
from tngram.memory.tngram_variants import TNGramVariantConfig


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
    summed = isinstance(c, TNGramVariantConfig) and c.order_combine == "sum"
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


def test_row_grad_adds_adds_the_lookups_factor_rows():
    """N 2, V 3, ids [1, 2, 1], pad 0: column k = 0 (the token) reads factor A_2 at offset
    (N-1-0) V = 3, rows 4, 5, 4; column k = 1 (the token before, pad at t = 0) reads A_1 at
    offset 0, rows 0, 1, 2 (tngram.kernels.tngram_lookup.ngram_row_index). So 6 rows of R are
    added into 6 factor rows, row 4 twice."""
    ids = torch.tensor([[1, 2, 1]])
    r = row_grad_adds(2, 3, 2, 0, {"a": ids, "b": ids}, reps=2, warmup=1, dev="cpu")
    assert (r["adds"], r["width"], r["rows"]) == (6, 2, 6)
    assert r["max_row_adds/a"] == r["max_row_adds/b"] == 2
    assert r["sorted_rel_diff/a"] == 0.0  # sums of at most two values: exact in any order
    assert set(r["timings"]) == {"copy", "atomic/a", "sorted/a", "atomic/b", "sorted/b"}
    assert all(t["reps"] == 2 for t in r["timings"].values())
    assert not torch.are_deterministic_algorithms_enabled()  # the sorted add's mode is undone


def test_row_grad_adds_at_a_lookups_shape_agree():
    """Many adds per row (V 16, 2 x 64 tokens, N 5): the sorted sums equal the atomic ones up
    to fp32 summation order (a few ulps of sums of ~40 unit normals)."""
    g = torch.Generator().manual_seed(0)
    ids = {"u": torch.randint(0, 16, (2, 64), generator=g), "z": zipf_ids(16, (2, 64), g)}
    r = row_grad_adds(5, 16, 8, 0, ids, reps=1, warmup=0, dev="cpu")
    assert (r["adds"], r["rows"]) == (640, 80)
    assert r["sorted_rel_diff/u"] < 1e-6 and r["sorted_rel_diff/z"] < 1e-6
    assert r["max_row_adds/z"] > r["max_row_adds/u"]  # id 0 takes ~30% of 128 draws (law below)


def test_zipf_ids_follow_the_law():
    """p(id r) = (1 / (r + 1)) / H_V; at V 8 and 80,000 draws each frequency is within 4
    standard deviations, sqrt(p (1 - p) / n) <= 0.0018, of it."""
    V, n = 8, 80_000
    x = zipf_ids(V, (n // 100, 100), torch.Generator().manual_seed(3))
    assert x.shape == (800, 100) and x.dtype == torch.int64 and 0 <= x.min() and x.max() < V
    harmonic = sum(1 / k for k in range(1, V + 1))
    for r in range(V):
        p = (1 / (r + 1)) / harmonic
        assert abs(float((x == r).float().mean()) - p) < 4 * (p * (1 - p) / n) ** 0.5
