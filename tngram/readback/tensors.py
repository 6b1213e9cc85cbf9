"""Tensors read back (checkpoints, saved folders): shape, dtype kind, finiteness and range checked
field by field, each failure one BadRecordError naming the file and the field."""

from __future__ import annotations

import math
from typing import Any

import torch

from tngram.readback import BadRecordError

# dtype kinds a field may be required to have
KINDS = {
    "float": lambda d: d.is_floating_point,
    "int": lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool,
}


def local(t: Any) -> torch.Tensor:
    """The local values of a tensor (a DTensor's shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def check_tensor(
    t: Any,
    where: str,
    field: str,
    *,
    shape: tuple[int, ...] | None = None,
    kind: str | None = None,
    dtype: torch.dtype | None = None,
    lo: float | None = None,
    hi: float | None = None,
    integral: bool = False,
) -> torch.Tensor:
    """`t` must be a tensor of `shape` (global shape for a DTensor), of dtype kind `kind` ("float",
    "int") or exactly `dtype`, with finite values in [lo, hi] (integer-valued when `integral`).
    Returns `t`; raises BadRecordError naming `where` and `field`."""
    if not torch.is_tensor(t):
        raise BadRecordError(f"{where}: {field} must be a tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise BadRecordError(
            f"{where}: {field} has shape {tuple(t.shape)}, expected {tuple(shape)} "
            f"(truncated, or written for another model)"
        )
    if dtype is not None and t.dtype != dtype:
        raise BadRecordError(f"{where}: {field} has dtype {t.dtype}, expected {dtype}")
    if kind is not None and not KINDS[kind](t.dtype):
        raise BadRecordError(f"{where}: {field} has dtype {t.dtype}, expected a {kind} dtype")
    v = local(t).detach()
    if v.numel() == 0:
        return t
    if v.is_floating_point():
        if not bool(torch.isfinite(v).all()):
            raise BadRecordError(f"{where}: {field} holds non-finite values (corrupt)")
        if integral and not bool((v == v.round()).all()):
            raise BadRecordError(f"{where}: {field} must hold whole numbers")
    if lo is not None or hi is not None:
        vmin, vmax = float(v.min()), float(v.max())
        if (lo is not None and vmin < lo) or (hi is not None and vmax > hi):
            raise BadRecordError(
                f"{where}: {field} must lie in [{_num(lo, '-inf')}, {_num(hi, 'inf')}], "
                f"holds values in [{vmin:g}, {vmax:g}]"
            )
    return t


def check_number(
    v: Any,
    where: str,
    field: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    integral: bool = False,
) -> float:
    """A plain number (JSON) or a 0-d tensor: finite, in [lo, hi], whole when `integral`."""
    if torch.is_tensor(v):
        check_tensor(v, where, field, shape=(), lo=lo, hi=hi, integral=integral)
        return float(v)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (not integral or float(v).is_integer())
    ok = ok and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        what = "a whole number" if integral else "a finite number"
        raise BadRecordError(
            f"{where}: {field} must be {what} in [{_num(lo, '-inf')}, {_num(hi, 'inf')}], "
            f"got {v!r:.60}"
        )
    return float(v)


def _num(x: float | None, none: str) -> str:
    return none if x is None else f"{x:g}"
