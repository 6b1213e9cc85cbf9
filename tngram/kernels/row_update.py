"""Which implementation updates the touched rows of a row-sparse table, with a first-use self-check.

The row-sparse optimisers (`tngram.optim.row_adams`: LazyAdam, RowwiseAdam, with or without
catch-up) update only the rows a step read. On CUDA, with triton importable, they run one Triton
kernel (`row_update_triton.py`: per touched row load -> update -> store, in place) instead of
torch's gather / update / scatter; everywhere else, the torch path (unchanged numbers on CPU).

Like the lookup's choice (`choice.py`), the kernel is trusted only after it has reproduced, in
this process, a float64 evaluation of the same update (`reference_row_update`) on small random
cases (both optimisers, with and without catch-up, rows of width not a power of two). Tolerance,
max |kernel - reference| / max(1, max |reference|) per output: fp32 1e-5 (a few fp32 roundings
of 2^-24 each per step, three steps), bf16/fp16 3e-2 (each intermediate rounded to 8 or 11
mantissa bits, 2^-8 = 3.9e-3, a few deep). A wrong kernel (wrong row, missing term) is off by
O(1). If the check fails or the kernel raises, "auto" warns once and uses torch from then on.

TNGRAM_ROW_UPDATE_IMPL (auto | torch | triton) forces one, without a self-check; "triton" also
runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1), as the tests do.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any

import torch
from torch import Tensor

from tngram.kernels.choice import SELF_CHECKS, triton_available

ROW_IMPLS = ("auto", "torch", "triton")
ROW_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
_CHOICE: dict[tuple[str, str], tuple[str, str]] = {}  # (device type, dtype) -> (impl, why)
ROW_SELF_CHECKS: dict[str, dict[str, Any]] = {}


def forced_row_impl() -> str:
    """TNGRAM_ROW_UPDATE_IMPL, validated ("auto" when unset)."""
    impl = os.environ.get("TNGRAM_ROW_UPDATE_IMPL", "auto")
    if impl not in ROW_IMPLS:
        raise ValueError(f"TNGRAM_ROW_UPDATE_IMPL must be one of {ROW_IMPLS}, got {impl!r}")
    return impl


def row_update_impl(device: torch.device, dtype: torch.dtype) -> str:
    """ "triton" or "torch": how a table on `device` with `dtype` gets its touched rows updated."""
    forced = forced_row_impl()
    if forced != "auto":
        return forced
    key = (device.type, str(dtype))
    if key not in _CHOICE:
        if device.type != "cuda":
            _CHOICE[key] = ("torch", f"no row-update kernel for {device.type}")
        elif not triton_available():
            _CHOICE[key] = ("torch", "triton not installed")
        else:
            rec = row_self_check(device, dtype)
            ROW_SELF_CHECKS[f"row_update/{rec['dtype']}"] = rec
            SELF_CHECKS[f"row_update/{rec['dtype']}"] = (
                rec  # env.json and `tngram doctor` list them
            )
            _CHOICE[key] = ("triton", "") if rec["passed"] else ("torch", _failed(rec))
            if not rec["passed"]:
                warnings.warn(f"tngram: {_CHOICE[key][1]}; using torch", RuntimeWarning, 2)
    return _CHOICE[key][0]


def resolved_row_impl(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which path a row-sparse table on `device`/`dtype` takes, with the reason when it is not
    the kernel (for run provenance; runs the self-check if not done yet)."""
    forced = forced_row_impl()
    if forced != "auto":
        return f"{forced} (TNGRAM_ROW_UPDATE_IMPL)"
    device = torch.device(device)
    impl = row_update_impl(device, dtype)
    why = _CHOICE[(device.type, str(dtype))][1]
    return impl if not why else f"{impl} ({why})"


def row_kernel_failed(device: torch.device, dtype: torch.dtype, err: BaseException) -> None:
    """The kernel raised in a step: one warning line, torch for this (device, dtype) from now."""
    why = f"row-update kernel raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    _CHOICE[(device.type, str(dtype))] = ("torch", why)
    warnings.warn(f"tngram: {why}; using torch", RuntimeWarning, 3)


def _failed(rec: dict[str, Any]) -> str:
    err = f", {rec['error']}" if rec["error"] else ""
    return (
        f"row-update kernel failed its self-check on {rec['device']} {rec['dtype']} (max rel err "
        f"{rec['max_rel_err']}, tolerance {rec['tolerance']}{err})"
    )


def row_update(
    w: Tensor, m: Tensor, v: Tensor, rows: Tensor, grad: Tensor | None, **kw: Any
) -> None:
    """The Triton kernel (`row_update_triton.triton_row_update`, same arguments), lazily."""
    from tngram.kernels.row_update_triton import triton_row_update

    triton_row_update(w, m, v, rows, grad, **kw)


def reference_row_update(
    w: Tensor,
    m: Tensor,
    v: Tensor,
    rows: Tensor,
    grad: Tensor | None,
    *,
    rowwise: bool,
    t: int,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    catchup: tuple[Tensor, Tensor] | None = None,
) -> None:
    """The update the kernel makes, in the tensors' dtype (float64 for the self-check), written
    from the formulas (tngram.optim.row_adams), in place. catchup: (k (U,) missed steps, coef (U,)
    float64 summed missed-move factor): missed = -coef m/sqrt(v) (v > 0), moments decayed by
    b1^k, b2^k, before the step at t."""
    W = w.shape[-1]
    wr, mr, vr = w[rows], m[rows], v[rows]
    if catchup is not None:
        k, coef = (x.to(w.dtype) for x in catchup)
        inv = torch.where(vr > 0, vr.rsqrt(), torch.zeros_like(vr))  # (U,) rowwise, else (U, W)
        wr = wr - coef.unsqueeze(1) * mr * (inv.unsqueeze(1) if rowwise else inv)
        mr = mr * (b1**k).unsqueeze(1)
        vr = vr * (b2**k if rowwise else (b2**k).unsqueeze(1))
    if grad is not None:
        g = grad.to(w.dtype)
        mr = b1 * mr + (1 - b1) * g
        if rowwise:
            vr = b2 * vr + (1 - b2) * (g * g).sum(1) / W
            den = (vr.sqrt() / math.sqrt(1 - b2**t) + eps).unsqueeze(1)
            wr = wr - lr / (1 - b1**t) * mr / den
        else:
            vr = b2 * vr + (1 - b2) * g * g
            wr = wr - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * mr / (vr.sqrt() + eps)
    w[rows], m[rows], v[rows] = wr, mr, vr


def _case(rowwise: bool, catchup: bool, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n_rows, W, U = 37, 24, 13  # W not a power of two (lane masks); rows not all touched
    rows = torch.randperm(n_rows, generator=g)[:U].sort().values
    v = torch.rand(n_rows, generator=g) if rowwise else torch.rand(n_rows, W, generator=g)
    v[rows[0]] = 0  # a never-stepped row: v = 0
    return {
        "w": torch.randn(n_rows, W, generator=g),
        "m": 0.1 * torch.randn(n_rows, W, generator=g),
        "v": 0.01 * v,
        "rows": rows,
        "grad": torch.randn(U, W, generator=g),
        "k": torch.randint(0, 4, (U,), generator=g) if catchup else None,
        "coef": 0.01 * torch.rand(U, generator=g, dtype=torch.float64) if catchup else None,
    }


def _compare(device: torch.device, dtype: torch.dtype) -> float:
    """Worst relative error of the kernel over the check cases, against float64 on the CPU."""
    worst = 0.0
    for seed, (rowwise, catchup) in enumerate(
        [(False, False), (True, False), (False, True), (True, True)]
    ):
        c = _case(rowwise, catchup, seed)
        t, lr, b1, b2, eps = 3 + seed, 0.05, 0.9, 0.95, 1e-8
        ref = [c[n].double() for n in ("w", "m", "v")]
        cu_ref = None if c["k"] is None else (c["k"], c["coef"])
        reference_row_update(
            ref[0],
            ref[1],
            ref[2],
            c["rows"],
            c["grad"].double(),
            rowwise=rowwise,
            t=t,
            lr=lr,
            b1=b1,
            b2=b2,
            eps=eps,
            catchup=cu_ref,
        )
        vdt = torch.float32 if rowwise else dtype
        got = [c["w"].to(device, dtype), c["m"].to(device, dtype), c["v"].to(device, vdt)]
        cu = None
        if c["k"] is not None:
            kd = c["k"].double()
            inv = torch.where(c["v"] > 0, c["v"].double().rsqrt(), torch.zeros(()).double())
            f = -c["coef"] * (inv[c["rows"]] if rowwise else 1.0)
            cu = tuple(x.to(device, dt) for x, dt in ((f, dtype), (b1**kd, dtype), (b2**kd, vdt)))
        row_update(
            got[0],
            got[1],
            got[2],
            c["rows"].to(device),
            c["grad"].to(device, dtype),
            rowwise=rowwise,
            t_mark=t,
            b1=b1,
            b2=b2,
            c_step=_c_step(rowwise, t, lr, b1, b2),
            bc2=math.sqrt(1 - b2**t),
            eps=eps,
            catchup=cu,
        )
        for x, r in zip(got, ref):
            x = x.double().cpu()
            if not bool(torch.isfinite(x).all()):
                return float("inf")
            worst = max(worst, (x - r).abs().max().item() / max(1.0, r.abs().max().item()))
    return worst


def _c_step(rowwise: bool, t: int, lr: float, b1: float, b2: float) -> float:
    """The step's scalar factor of m / denominator (row_update_triton's c)."""
    return -lr / (1 - b1**t) if rowwise else -lr * math.sqrt(1 - b2**t) / (1 - b1**t)


def row_self_check(device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
    """Run the kernel against `reference_row_update` (float64, CPU); returns the result record."""
    device = torch.device(device)
    tol = ROW_TOLERANCE.get(dtype, 3e-2)
    rec: dict[str, Any] = {
        "impl": "triton",
        "device": str(device),
        "tolerance": tol,
        "dtype": str(dtype).replace("torch.", ""),
        "max_rel_err": None,
        "passed": False,
        "error": None,
    }
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            rec["max_rel_err"] = worst = _compare(device, dtype)
        rec["passed"] = worst <= tol
    except Exception as e:  # noqa: BLE001 -- a kernel that cannot run fails its check
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec["seconds"] = round(time.perf_counter() - t0, 4)
    return rec


def reset_row_choices() -> None:
    """Forget the choices and self-checks (tests)."""
    _CHOICE.clear()
    for k in ROW_SELF_CHECKS:
        SELF_CHECKS.pop(k, None)
    ROW_SELF_CHECKS.clear()


__all__ = [
    "ROW_IMPLS",
    "forced_row_impl",
    "reference_row_update",
    "reset_row_choices",
    "resolved_row_impl",
    "row_kernel_failed",
    "row_self_check",
    "row_update",
    "row_update_impl",
]
