"""Muon: Newton-Schulz against an SVD-based reference, and the update against a hand re-computation."""

from __future__ import annotations

import pytest
import torch

from tngram.optim.muon import NS_COEFFS, Muon, muon_scale, zeropower_newton_schulz


def polynomial_reference(G: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NS acts on singular values only: X_k = U diag(phi^k(s / ||G||_F)) V^T with
    phi(s) = a s + b s^3 + c s^5. Computed in float64 from an SVD, independently of the matmuls."""
    a, b, c = NS_COEFFS
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / G.double().norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag(s) @ Vh, s


@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (64, 64)])
def test_newton_schulz_matches_svd_polynomial(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)
    out = zeropower_newton_schulz(G, steps=5)
    assert out.dtype == torch.bfloat16 and out.shape == G.shape
    expected, s = polynomial_reference(G, 5)
    rel = (out.double() - expected).norm() / expected.norm()
    # bf16 arithmetic over 5 iterations: measured 2.3-2.9% relative Frobenius error; 5% bound.
    assert rel < 0.05, rel
    # a wrong result (e.g. just the normalised input) is far off
    assert (G.double() / G.norm() - expected).norm() / expected.norm() > 0.5


@pytest.mark.parametrize("shape", [(32, 128), (128, 32)])
def test_newton_schulz_is_near_orthogonal(shape):
    """Singular values land in the band of the iterated quintic: phi^5 maps the normalised
    singular values of a Gaussian matrix into about [0.68, 1.13]; allow 0.03 for bf16."""
    torch.manual_seed(1)
    G = torch.randn(*shape)
    sv = torch.linalg.svdvals(zeropower_newton_schulz(G).double())
    _, s = polynomial_reference(G, 5)
    assert sv.min() >= s.min() - 0.03 and sv.max() <= s.max() + 0.03
    assert 0.6 <= sv.min() and sv.max() <= 1.2
    # the input itself is nowhere near orthogonal: its normalised singular values are << 1
    assert torch.linalg.svdvals(G / G.norm()).max() < 0.3


def test_muon_scale():
    assert muon_scale((1024, 512)) == 2 ** 0.5      # parameter-golf: only the MLP fc gets sqrt(2)
    assert muon_scale((512, 1024)) == 1.0
    assert muon_scale((512, 512)) == 1.0


def test_muon_update_equals_hand_computation():
    """Two steps of Muon on a tall and a wide matrix == momentum/Nesterov/NS/scale done by hand."""
    torch.manual_seed(2)
    p_tall, p_wide = torch.randn(24, 12), torch.randn(12, 24)
    params = [torch.nn.Parameter(p_tall.clone()), torch.nn.Parameter(p_wide.clone())]
    lr, mu = 0.04, 0.9
    opt = Muon(params, lr=lr, momentum=mu, nesterov=True, ns_steps=5)
    grads = [[torch.randn(24, 12), torch.randn(12, 24)] for _ in range(2)]
    expected = [p_tall.clone(), p_wide.clone()]
    bufs = [torch.zeros(24, 12), torch.zeros(12, 24)]
    for g_step in grads:
        for p, g in zip(params, g_step):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(g_step):
            bufs[i] = bufs[i] * mu + g
            u = g + mu * bufs[i]                                  # Nesterov
            u = zeropower_newton_schulz(u, 5)
            rows, cols = u.shape
            u = u * max(1.0, rows / cols) ** 0.5                  # sqrt(2) for the tall one
            expected[i] = expected[i] - lr * u.float()
    for p, e in zip(params, expected):
        # the hand computation uses plain ops (a*b + c) where Muon uses fused in-place ones, which
        # may round the last fp32 bit differently and flip a bf16 rounding in NS: 1 bf16 ulp of
        # an O(1) update entry times lr = 0.04 * 2^-7 = 3.1e-4 bounds the difference.
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=3.2e-4)
    # and the update is not trivially zero: the parameters moved by about lr per step
    assert (params[0].detach() - p_tall).abs().mean() > 0.01


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(5))])


def test_stacked_newton_schulz_is_each_matrix_on_its_own():
    """A (k, rows, cols) stack: each matrix normalised by its own norm and orthogonalised on its
    own. On the CPU the batched matmuls give the per-matrix bits exactly (measured), so the
    comparison is equality (the per-matrix function is checked against the SVD above); the
    matrices differ in scale by up to 10^6, so one norm shared by the stack would not pass."""
    torch.manual_seed(3)
    for shape in [(3, 24, 40), (4, 40, 24), (2, 32, 32)]:  # wide, tall (transposed), square
        G = torch.randn(*shape) * torch.tensor([1e-3, 1.0, 1e3, 7.0])[: shape[0], None, None]
        out = zeropower_newton_schulz(G, steps=5)
        assert out.dtype == torch.bfloat16 and out.shape == G.shape
        for k in range(shape[0]):
            assert torch.equal(out[k], zeropower_newton_schulz(G[k], steps=5)), (shape, k)


def _mixed_params() -> list[torch.nn.Parameter]:
    """Shapes as in a GPT block: repeated (stacked), tall and wide, and one of a kind."""
    torch.manual_seed(4)
    shapes = [(16, 16), (8, 16), (8, 16), (16, 16), (32, 16), (16, 32), (16, 16), (12, 20)]
    return [torch.nn.Parameter(torch.randn(*s)) for s in shapes]


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_stacked_by_shape_equals_one_matrix_at_a_time(nesterov):
    """stack_shapes=True (the CUDA default) against the per-matrix loop, 3 steps with the
    momentum buffers carried: bit-equal on the CPU. One parameter has no gradient at step 2
    (it must not move, and its buffer must not change), so the share of a stack changes."""
    runs = {}
    for stack in (False, True):
        params = _mixed_params()
        opt = Muon(params, lr=0.03, momentum=0.9, nesterov=nesterov, stack_shapes=stack)
        g = torch.Generator().manual_seed(5)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = None if (step == 1 and i == 3) else torch.randn(p.shape, generator=g)
            before = params[3].detach().clone()
            opt.step()
            if step == 1:
                assert torch.equal(params[3].detach(), before)
        runs[stack] = [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]
    (w0, b0), (w1, b1) = runs[False], runs[True]
    for a, b in zip(w0 + b0, w1 + b1):
        assert torch.equal(a, b)
    # the steps did move every matrix: an orthogonal-like (m, n) update has entries of RMS
    # 1/sqrt(max(m, n)) >= 1/sqrt(32), times lr 0.03 is 5e-3 a step (measured 8.5e-3 - 1.3e-2)
    for p0, p in zip(_mixed_params(), w0):
        assert (p - p0.detach()).abs().mean() > 2e-3


def test_muon_impl_follows_the_device_and_the_environment(monkeypatch):
    from tngram.common import TngramError
    from tngram.optim.muon import muon_impl

    monkeypatch.delenv("TNGRAM_MUON_IMPL", raising=False)
    assert muon_impl("cpu") == "loop" and muon_impl(torch.device("cuda")) == "stacked"
    monkeypatch.setenv("TNGRAM_MUON_IMPL", "stacked")
    assert muon_impl("cpu") == "stacked"
    monkeypatch.setenv("TNGRAM_MUON_IMPL", "loop")
    assert muon_impl("cuda") == "loop"
    monkeypatch.setenv("TNGRAM_MUON_IMPL", "batched")
    with pytest.raises(TngramError, match="TNGRAM_MUON_IMPL must be one of"):
        muon_impl("cpu")


def test_a_bad_muon_impl_stops_train_before_any_model(tmp_path):
    """The CLI path: one line naming the variable, exit 2, nothing written."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TNGRAM_MUON_IMPL="fast")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tngram", "train", "mini-raw", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "tngram: error: TNGRAM_MUON_IMPL must be one of ('auto', 'loop', 'stacked'), got 'fast'"
    ]
    assert not out.exists()


def test_stacked_step_dispatches_a_tenth_of_the_ops():
    """What stacking is for: the ops (on a GPU, kernel launches) of one Muon step of a 9-block
    GPT (paper-l9's 54 matrices in 4 shapes, at a tiny width). Per matrix, the loop dispatches
    the Newton-Schulz function's ~40 ops (5 iterations of 3 matmuls and their scale-and-adds,
    the norm) and ~6 for momentum, Nesterov, scale and update: about 46 x 54 = 2,500. Stacked:
    ~40 x 4 Newton-Schulz ops, 4 stacks and casts, and 4 multi-tensor ops: under 250 (measured
    2,490 and 194)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups
    from tngram.train.recipes import resolve_config

    views = {"view", "_unsafe_view", "t", "transpose", "detach", "alias", "slice", "select",
             "unbind", "as_strided", "expand", "split", "split_with_sizes", "unsqueeze"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in views:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    sets = ["model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.sequence_len=64"]
    cfg = resolve_config("paper-l9-raw", sets)
    torch.manual_seed(0)
    net = GPT(cfg.model)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    groups = [g for g in build_param_groups(net, cfg.optim) if g["optimizer"] == "muon"]
    assert sum(len(g["params"]) for g in groups) == 54
    counts = {}
    for stack in (False, True):
        opt = Muon([dict(g) for g in groups], stack_shapes=stack)
        opt.step()  # the first step makes the momentum buffers
        Count.n = 0
        with Count():
            opt.step()
        counts[stack] = Count.n
    assert counts[False] > 2000 and counts[True] < 250, counts


def test_compiled_stacked_step_is_as_accurate_as_the_loop():
    """The CUDA default is stacked + compiled Newton-Schulz; on the CPU inductor compiles the
    same function. Compiled, the bits differ from eager (fused scale-and-adds round once), so
    the check is accuracy: every matrix's first update against the fp64 SVD evaluation of the
    iterated polynomial, within the 5% bound of the eager test above (measured 2-3% on
    paper-l9's shapes for both the compiled loop and the compiled stacks), and no fallback to
    eager."""
    import torch._dynamo

    torch.manual_seed(6)
    shapes = [(24, 40), (40, 24), (24, 40), (40, 24), (24, 40)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    grads = [torch.randn(*s) for s in shapes]
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    torch._dynamo.reset()
    opt = Muon(params, lr=1.0, momentum=0.95, stack_shapes=True)
    opt.use_compiled_ns()
    opt.step()
    assert opt.ns_compile_error is None and opt._ns is not zeropower_newton_schulz
    for p, b, g in zip(params, before, grads):
        expected, _ = polynomial_reference(g * 1.95, 5)  # Nesterov at step 1: g + 0.95 g
        expected = expected * muon_scale(g.shape)
        got = (b - p.detach()).double()
        assert (got - expected).norm() / expected.norm() < 0.05
    torch._dynamo.reset()


def test_a_stacked_state_resumes_in_the_loop_and_back():
    """A checkpoint written on a GPU (stacked) resumes on the CPU (per matrix) and back: both
    keep one momentum buffer per parameter, so the state dicts are interchangeable; on the CPU
    the continued runs are bit-equal."""
    g = torch.Generator().manual_seed(7)
    grads = [[torch.randn(p.shape, generator=g) for p in _mixed_params()] for _ in range(4)]

    def run(modes: list[bool]) -> list[torch.Tensor]:
        params = _mixed_params()
        state = None
        for step, stack in enumerate(modes):  # a fresh optimiser per step: save, then resume
            opt = Muon(params, lr=0.02, momentum=0.9, stack_shapes=stack)
            if state is not None:
                opt.load_state_dict(state)
            for p, gr in zip(params, grads[step]):
                p.grad = gr.clone()
            opt.step()
            state = opt.state_dict()
        return [p.detach() for p in params]

    ref = run([False] * 4)
    for modes in ([True, False, True, False], [True] * 4):
        assert all(torch.equal(a, b) for a, b in zip(run(modes), ref))
