"""Tensors read back (checkpoints, saved folders): shape, dtype kind, finiteness and range checked
field by field, each failure one BadRecordError naming the file and the field."""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, NamedTuple

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


# ---- safetensors files: the one reader of every tensor file tngram reads back

# bytes per element of each safetensors dtype
ST_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound
_BAD = "corrupt or truncated safetensors file"


class SafetensorsHeader(NamedTuple):
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape
    dtypes: dict[str, str]  # tensor name -> safetensors dtype
    metadata: dict[str, str]
    payload_offset: int  # where the tensor bytes begin (8 + header length)
    size: int  # the file's size in bytes


def _header(fd: int, where: str, limit: int | None) -> SafetensorsHeader:
    """The checked header of the safetensors file open as `fd` (see read_safetensors)."""
    from tngram.readback import parse_json

    size = os.fstat(fd).st_size
    if limit is not None and size > limit:
        raise BadRecordError(f"{where}: larger than {limit:,} bytes; not a file tngram wrote")
    if size < 8:
        raise BadRecordError(f"{where}: {_BAD} ({size} bytes: not even a header)")
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise BadRecordError(f"{where}: {_BAD} (a {n:,}-byte header in a {size:,}-byte file)")
    raw = parse_json(os.pread(fd, n, 8), f"{where} (header)", max_depth=4)
    if not isinstance(raw, dict):
        raise BadRecordError(f"{where}: {_BAD} (its header is not an object)")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise BadRecordError(f"{where}: field __metadata__ must map strings to strings")
    shapes, dtypes, spans = {}, {}, []
    for name, e in raw.items():
        shape = e.get("shape") if isinstance(e, dict) else None
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        dtype = e.get("dtype") if isinstance(e, dict) else None
        if (
            dtype not in ST_DTYPES
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            or offs[1] - offs[0] != math.prod(shape) * ST_DTYPES[dtype]
        ):
            raise BadRecordError(
                f"{where}: tensor {name[:80]!r} has a corrupt header entry (dtype, shape and "
                f"data_offsets must agree)"
            )
        shapes[name], dtypes[name] = tuple(shape), dtype
        spans.append((offs[0], offs[1], name))
    end = 0
    for a, b, name in sorted(spans):
        if a != end:
            raise BadRecordError(f"{where}: tensor {name[:80]!r} overlaps or leaves a gap")
        end = b
    have = size - 8 - n
    if have < end:
        raise BadRecordError(
            f"{where}: {_BAD} ({have:,} payload bytes, the header lists {end:,}: truncated)"
        )
    if have > end:
        raise BadRecordError(
            f"{where}: {_BAD} ({have - end:,} bytes after the tensors its header lists: "
            f"oversized, or appended to)"
        )
    return SafetensorsHeader(shapes, dtypes, meta, 8 + n, size)


def read_safetensors_header(
    path: str | os.PathLike, root: str | os.PathLike | None = None, limit: int | None = None
) -> SafetensorsHeader:
    """The checked header of a safetensors file (no tensor is read): see read_safetensors."""
    from tngram.safefs import open_fd

    fd = open_fd(path, root)
    try:
        return _header(fd, str(path), limit)
    finally:
        os.close(fd)


def payload_sha256(fd: int, offset: int) -> tuple[int, str]:
    """(bytes, sha256 hex) of the file open as `fd` from `offset` to its end."""
    h, n, pos = hashlib.sha256(), 0, offset
    while chunk := os.pread(fd, 1 << 22, pos):
        h.update(chunk)
        n += len(chunk)
        pos += len(chunk)
    return n, h.hexdigest()


def payload_digest(
    path: str | os.PathLike, root: str | os.PathLike | None = None
) -> tuple[int, str, SafetensorsHeader]:
    """(payload bytes, payload sha256, checked header) of a safetensors file, read without links."""
    from tngram.safefs import open_fd

    fd = open_fd(path, root)
    try:
        head = _header(fd, str(path), None)
        return (*payload_sha256(fd, head.payload_offset), head)
    finally:
        os.close(fd)


def read_safetensors(
    path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    *,
    limit: int | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    digest: str | None = None,
    finite: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header metadata) of a safetensors file tngram reads back, checked before use:

    a regular file reached without links (below `root` when given: tngram.safefs), at most
    `limit` bytes (checked before reading); its header strict JSON whose entries agree with each
    other and with the file's size (a truncated or oversized file is named as such); with
    `shapes`, exactly those tensor names of those shapes (checked on the header, before any
    tensor is read); with `digest`, the sha256 of the payload (the bytes after the header); every
    float tensor finite (`finite`). Each failure is one BadRecordError naming the file and the
    tensor."""
    from safetensors import safe_open

    from tngram.safefs import open_fd

    where = str(path)
    fd = open_fd(path, root)
    try:
        head = _header(fd, where, limit)
        if shapes is not None:
            check_names(head.shapes, shapes, where)
        if digest is not None:
            size, got = payload_sha256(fd, head.payload_offset)
            if got != digest:
                raise BadRecordError(
                    f"{where}: the payload ({size:,} bytes) does not match its recorded sha256 "
                    f"(corrupt or replaced)"
                )
        alias = f"/proc/self/fd/{fd}"  # the file just checked, never another one swapped in
        name = alias if os.path.exists(alias) else os.fspath(path)
        try:
            with safe_open(name, framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors' own error names no file
            raise BadRecordError(f"{where}: {_BAD} ({str(e).splitlines()[0][:120]})") from None
    finally:
        os.close(fd)
    if finite:
        for k, t in tensors.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise BadRecordError(
                    f"{where}: tensor {k} holds non-finite values (NaN or inf): corrupt, or "
                    f"saved from a diverged model"
                )
    return tensors, head.metadata


def check_names(
    have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]], where: str
) -> None:
    """The tensor names and shapes of a file (`have`) are exactly `want`'s."""
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise BadRecordError(
            f"{where}: the tensors do not match what the model needs: missing {missing[:3]}, "
            f"unexpected {extra[:3]}"
        )
    for k, shape in want.items():
        if tuple(have[k]) != tuple(shape):
            raise BadRecordError(
                f"{where}: tensor {k} has shape {tuple(have[k])}, the model needs "
                f"{tuple(shape)} (written for another model or config)"
            )


def check_finite_module(module: Any, where: str) -> None:
    """Every floating tensor of a loaded module's state (weights and buffers; tensors still on
    the meta device skipped) is finite; else one BadRecordError naming the first."""
    bad = [
        k
        for k, t in module.state_dict().items()
        if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all())
    ]
    if bad:
        raise BadRecordError(
            f"{where}: non-finite values in {bad[0]} ({len(bad)} tensor(s)); the weights are "
            f"corrupt or diverged"
        )
