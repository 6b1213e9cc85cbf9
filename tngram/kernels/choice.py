"""Which lookup implementation impl="auto" runs, with a first-use self-check of compiled kernels.

A compiled kernel (Triton on CUDA, C on CPU) is only trusted after it has reproduced the plain
torch computation in this process: the first time "auto" would pick it for a (device type,
dtype), `self_check` runs it on two small random cases (forward and the gradients of factors,
absorption and scales) against `plain_lookup` in float64 on the CPU, and if any value differs by
more than the dtype's tolerance, or the kernel raises, "auto" uses the torch path for that
(device type, dtype) from then on and warns once. Results are kept in `SELF_CHECKS` (recorded in
a run's env.json and printed by `tngram doctor`).

Tolerances (max |kernel - reference| / max(1, max |reference|), per output): fp32 1e-4 (both
compute in fp32; the kernels' known error is below 2e-5, tests/test_fused_lookup.py), bf16/fp16
3e-2 (inputs, outputs and gradients are rounded to 8 or 11 mantissa bits: 2^-8 = 3.9e-3 per
rounding, a few roundings deep). A wrong kernel (a bad index, a missing term) is off by O(1).

TNGRAM_LOOKUP_IMPL (auto | torch | c | triton) forces one implementation, without a self-check.
`choose_impl` is a constant for torch.compile (marked as `assume_constant_result` does): it runs
once, eagerly, while the graph is traced, and the graph keeps its answer.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tngram.kernels.policy import TRITON_BACKWARDS, kernel_policy
from tngram.kernels.tngram_c import c_lookup, c_unavailable_reason
from tngram.kernels.tngram_lookup import (
    FusedTNGramLookup,
    absorption_weights,
    ngram_row_index,
    plain_lookup,
)

IMPLS = ("auto", "torch", "c", "triton")
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def _triton_lookup(*args: Any, **kw: Any) -> Tensor:
    from tngram.kernels.tngram_triton import triton_lookup  # lazy: imports triton

    return triton_lookup(*args, **kw)


# writes e in bf16 directly when asked (tngram_triton.triton_lookup's out_dtype)
_triton_lookup.out_dtypes = (torch.bfloat16,)  # type: ignore[attr-defined]
_triton_lookup.sums_orders = True  # type: ignore[attr-defined]


# impl -> fn(factors, idx, W, scales, use_norm, eps, chunk) -> e (M, N-1, R); a dict so a test
# can swap in a wrong kernel and watch the self-check reject it
IMPL_FNS: dict[str, Callable[..., Tensor]] = {
    "torch": FusedTNGramLookup.apply,
    "c": c_lookup,
    "triton": _triton_lookup,
}

_CHOICE: dict[tuple[str, str], tuple[str, str]] = {}  # (device type, dtype) -> (impl, why)
SELF_CHECKS: dict[str, dict[str, Any]] = {}  # "c/torch.float32" -> result


def triton_available() -> bool:
    """True when the `triton` package can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def forced_impl() -> str:
    """TNGRAM_LOOKUP_IMPL, validated ("auto" when unset)."""
    impl = os.environ.get("TNGRAM_LOOKUP_IMPL", "auto")
    if impl not in IMPLS:
        raise ValueError(f"TNGRAM_LOOKUP_IMPL must be one of {IMPLS}, got {impl!r}")
    return impl


def candidate(device_type: str, dtype: torch.dtype) -> tuple[str, str]:
    """(compiled kernel "auto" would like to use, or "torch", and why)."""
    if device_type == "cuda":
        return ("triton", "") if triton_available() else ("torch", "triton not installed")
    if device_type != "cpu":
        return "torch", f"no kernel for {device_type}"
    if dtype != torch.float32:
        return "torch", f"{dtype} factors"
    reason = c_unavailable_reason()
    return ("c", "") if reason is None else ("torch", f"C kernel unavailable: {reason[:200]}")


def _case(
    N: int, dtype: torch.dtype, device: torch.device, absorb: bool, scales: bool
) -> tuple[list[Tensor | None], Tensor, Tensor]:
    """Random factors (sign x exp(0.3 g), the init's shape), absorb, log-scales, ids, upstream."""
    g = torch.Generator().manual_seed(1234 + N)
    V, R, M = 11, 40, 50  # R not a power of two; V small: repeated rows
    sign = torch.randint(0, 2, (N, V, R), generator=g) * 2 - 1
    f = sign * torch.exp(0.3 * torch.randn(N, V, R, generator=g))
    a = 1 + 0.2 * torch.randn(N - 2, R, generator=g) if absorb and N > 2 else None
    ls = 0.3 * torch.randn(N - 1, generator=g) if scales else None
    ngrams = torch.randint(0, V, (1, M, N), generator=g)
    up = torch.randn(M, N - 1, R, generator=g)
    leaves = [None if x is None else x.to(dtype) for x in (f, a, ls)]
    return leaves, ngrams, up


def _run(
    fn: Callable[..., Tensor],
    leaves: list[Tensor | None],
    ngrams: Tensor,
    up: Tensor,
    use_norm: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> list[Tensor]:
    """e and the gradients of the given leaves, computed by fn on device in dtype."""
    ps = [None if x is None else x.to(device=device, dtype=dtype).requires_grad_() for x in leaves]
    f, a, ls = ps
    assert f is not None  # the factors are always a leaf
    N, V, R = f.shape
    W = absorption_weights(
        None if a is None else (a.float() if dtype != torch.float64 else a), N, R, f
    )
    s = None if ls is None else torch.exp(ls.float() if dtype != torch.float64 else ls)
    idx = ngram_row_index(ngrams.to(device), V)
    e = fn(f, idx, W, s, use_norm, 1e-6, 64)
    live = [p for p in ps if p is not None]
    grads = torch.autograd.grad(e, live, up.to(device=device, dtype=e.dtype))
    return [e.detach().double().cpu(), *(gr.double().cpu() for gr in grads)]


def self_check(impl: str, device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
    """Run IMPL_FNS[impl] against plain_lookup (fp64, CPU); returns the result record."""
    device = torch.device(device)
    tol = TOLERANCE.get(dtype, 3e-2)
    rec: dict[str, Any] = {
        "impl": impl,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "tolerance": tol,
        "max_rel_err": None,
        "passed": False,
        "error": None,
    }
    t0 = time.perf_counter()
    try:
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast(device.type, enabled=False),
        ):  # whatever the caller's context
            worst = _compare(impl, device, dtype)
        rec["max_rel_err"] = worst
        rec["passed"] = worst <= tol
    except Exception as e:  # a kernel that cannot run is a failed check, not a crash
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec["seconds"] = round(time.perf_counter() - t0, 4)
    return rec


def _compare(impl: str, device: torch.device, dtype: torch.dtype) -> float:
    """Worst relative error of IMPL_FNS[impl] over the check cases (inf if not finite)."""
    worst = 0.0
    for N, use_norm, absorb, scales in (
        (4, True, True, True),
        (2, False, False, True),
        (5, True, False, False),
    ):
        leaves, ngrams, up = _case(N, dtype, device, absorb, scales)
        ref = _run(plain_lookup, leaves, ngrams, up, use_norm, torch.device("cpu"), torch.float64)
        # the Triton kernel: each backward kernel_policy can pick, so whichever runs was checked
        for bwd in TRITON_BACKWARDS if impl == "triton" else (None,):
            with kernel_policy(**({} if bwd is None else {"triton_backward": bwd})):
                got = _run(IMPL_FNS[impl], leaves, ngrams, up, use_norm, device, dtype)
            for x, r in zip(got, ref):
                if x.shape != r.shape or not bool(torch.isfinite(x).all()):
                    return float("inf")
                worst = max(worst, (x - r).abs().max().item() / max(1.0, r.abs().max().item()))
    return worst


def choose_impl(device_type: str, dtype_name: str) -> str:
    """The implementation impl="auto" runs for factors on `device_type` with dtype `dtype_name`
    (e.g. "torch.float32"): TNGRAM_LOOKUP_IMPL if set, else the compiled kernel when it passed
    its self-check, else "torch"."""
    forced = forced_impl()
    if forced != "auto":
        return forced
    return _auto(device_type, dtype_name)[0]


# torch.compiler.assume_constant_result(choose_impl) only sets this attribute; setting it directly
# keeps `import tngram` from importing torch._dynamo (~1.5 s CPU; it also imports triton).
# tests/test_compile.py fails if a torch release changes the mechanism (graph breaks appear).
choose_impl._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _auto(device_type: str, dtype_name: str) -> tuple[str, str]:
    key = (device_type, dtype_name)
    if key not in _CHOICE:
        dtype = getattr(torch, dtype_name.replace("torch.", ""))
        impl, why = candidate(device_type, dtype)
        if impl != "torch":
            rec = self_check(impl, device_type, dtype)
            SELF_CHECKS[f"{impl}/{dtype_name.replace('torch.', '')}"] = rec
            if not rec["passed"]:
                why = (
                    f"{impl} kernel failed its self-check on {device_type} {rec['dtype']} "
                    f"(max rel err {rec['max_rel_err']}, tolerance {rec['tolerance']}"
                    f"{', ' + rec['error'] if rec['error'] else ''})"
                )
                warnings.warn(
                    f"tngram: the {why}; using the torch path instead", RuntimeWarning, stacklevel=3
                )
                impl = "torch"
        _CHOICE[key] = (impl, why)
    return _CHOICE[key]


def resolved_impl(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which path impl="auto" takes for factors on `device`/`dtype`, with the reason when it is
    not the compiled kernel (for run provenance; runs the self-check if not done yet)."""
    forced = forced_impl()
    if forced != "auto":
        return f"{forced} (TNGRAM_LOOKUP_IMPL)"
    impl, why = _auto(torch.device(device).type, str(dtype))
    return impl if not why else f"{impl} ({why})"


def self_check_results() -> dict[str, dict[str, Any]]:
    """Every self-check run in this process, keyed "impl/dtype"."""
    return {k: dict(v) for k, v in SELF_CHECKS.items()}


def reset_choices() -> None:
    """Forget the choices and self-checks (tests; a new compiler or library)."""
    _CHOICE.clear()
    SELF_CHECKS.clear()
