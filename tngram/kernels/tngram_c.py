"""The C fused lookup (`tngram_lookup.c`): built once with the system compiler, called via ctypes.

Why C and not more torch ops: the torch path (`tngram_lookup.py`) is bounded by ~20 separate
elementwise passes per chunk and ~700 op dispatches per fwd+bwd; the C loop does each token's
gather, products, norm and scale in one pass over L1-resident rows, and the backward adds
straight into the factor gradient (no (c, N, R) buffers). No torch headers are involved, so the
build takes well under a second; the library is cached under `<cache>/kernels/` keyed by the
source, the compiler, its flags and the CPU's feature flags (the build uses -march=native).

Threads: built with -fopenmp, the library's libgomp.so.1 dependency resolves to the libgomp torch
already loaded (same soname), so the kernel and torch share one OpenMP runtime; each call uses
torch.get_num_threads() threads. Results do not depend on the thread count (see the C file).
Without OpenMP support the build falls back to a single-threaded library.

Id bounds: the C loops do not check ids; `tn_count_bad_ids` (one pass over the (M, N) ids, no
device sync: the tensors are on the CPU) runs first and the forward raises if any is out of range.

Used by `fused_lookup` for fp32 CPU tensors when the build works (`impl="auto"`); if there is no
C compiler or the build fails, the torch path runs instead and `c_unavailable_reason()` says why.
`TNGRAM_LOOKUP_IMPL=c` forces it (and errors if it cannot be built). `CC` picks the compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("tngram_lookup.c")
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3", "-march=native", "-fopenmp-simd"],
    ["-O3"],
)
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def _build(cc: str, flags: list[str], out: Path) -> None:
    """Compile SOURCE into the shared library `out` (atomically: temp file + rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-fPIC", "-shared", "-o", tmp, str(SOURCE), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    from tngram.common import cache_dir

    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler: {cc!r} is not on PATH (set CC)")
    src = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(
            b"\0".join(
                [
                    src,
                    cc.encode(),
                    " ".join(flags).encode(),
                    _cpu_flags().encode(),
                    torch.__version__.encode(),
                ]
            )
        )
        lib = cache_dir() / "kernels" / f"tngram_lookup-{key.hexdigest()[:16]}.so"
        try:
            if not lib.exists():
                _build(cc, flags, lib)
                loaded = _open(lib)
            else:
                loaded = _open_cached(cc, flags, lib)
            _STATE["flags"], _STATE["path"] = " ".join(flags), str(lib)
            return loaded
        except OSError as e:
            errors.append(str(e))
    raise OSError("; ".join(errors))


def _open(lib: Path, name: str | None = None) -> ctypes.CDLL:
    """The library at `lib` (opened as `name` if given) with its functions declared; OSError if
    it does not load or lacks one of them."""
    try:
        return _declare(ctypes.CDLL(name or str(lib)))
    except AttributeError as e:  # a shared library without our symbols
        raise OSError(f"{lib} lacks the kernel functions ({e})") from None


def _open_cached(cc: str, flags: list[str], lib: Path) -> ctypes.CDLL:
    """A cached library that does not load (damaged, replaced, or without our functions) is
    rebuilt with the SAME flags, said in one line; if the rebuild fails, OSError."""
    try:
        return _open(lib)
    except OSError as e:
        reason = str(e).splitlines()[0][:160]
    print(
        f"tngram: note: the cached C kernel {lib} does not load ({reason}); rebuilding it with "
        f"the same flags ({' '.join(flags)})",
        file=sys.stderr,
        flush=True,
    )
    lib.unlink(missing_ok=True)
    _build(cc, flags, lib)
    # dlopen returns the library it already holds under the same path string (the one without
    # our functions): the rebuilt file (a new inode) is opened under another spelling of its path
    return _open(lib, os.path.join(str(lib.parent), ".", lib.name))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.tn_count_bad_ids.argtypes = [p, i64, i64, i64, i32]
    lib.tn_count_bad_ids.restype = i64
    lib.tn_lookup_forward.argtypes = [p, p, p, p, i64, i64, i64, i32, f32, p, p, i32, i32]
    lib.tn_lookup_forward.restype = None
    lib.tn_lookup_backward.argtypes = [p, p, p, p, p, p, i64, i64, i64, p, p, p, i32, i32]
    lib.tn_lookup_backward.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None if that is impossible."""
    with _LOCK:
        if "lib" not in _STATE:
            try:
                _STATE["lib"], _STATE["reason"] = _load(), None
            except OSError as e:
                _STATE["lib"], _STATE["reason"] = None, str(e)
        return _STATE["lib"]  # type: ignore[return-value]


def c_unavailable_reason() -> str | None:
    """None when the C kernels load, else why not (building them if not tried yet)."""
    library()
    return _STATE.get("reason")  # type: ignore[return-value]


def c_build_info() -> dict[str, object]:
    """How the C kernel was built: compiler, flags (OpenMP or not), library path; reason if not."""
    library()
    return {
        "cc": os.environ.get("CC") or "cc",
        "flags": _STATE.get("flags"),
        "openmp": "-fopenmp" in str(_STATE.get("flags", "")).split(),
        "library": _STATE.get("path"),
        "unavailable": _STATE.get("reason"),
    }


def c_supported(factors: Tensor) -> bool:
    """The C path handles contiguous-able fp32 CPU factors (others use the torch path)."""
    return factors.device.type == "cpu" and factors.dtype == torch.float32


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C lookup is unavailable: {c_unavailable_reason()}")
    return lib


# Two torch.library custom ops (forward, backward) with fake implementations, so torch.compile
# sees opaque ops with known output shapes instead of tracing into ctypes (fake tensors have no
# data). Optional outputs are returned as empty tensors. `Optional[...]` rather than `X | None`
# in the op signatures: torch's schema inference parses these annotations.


def lookup_forward(
    factors: Tensor,
    idx: Tensor,
    W: Tensor,
    scales: Optional[Tensor],
    use_norm: bool,
    eps: float,
    out_bf16: bool = False,
) -> tuple[Tensor, Tensor]:
    """factors (N, V, R) fp32, idx (M, N) row ids, W (N-1, R) -> e (M, N-1, R), r (M, N-1 | 0).

    e is fp32, or with out_bf16 bf16: the same fp32 values rounded once in C, bit-identical to
    `e.to(torch.bfloat16)` (what bf16 autocast does to it before the K/V matmul)."""
    N, V, R = factors.shape
    M = idx.shape[0]
    table, idx = factors.contiguous(), idx.contiguous()
    lib, nt = _lib(), torch.get_num_threads()
    if M and lib.tn_count_bad_ids(idx.data_ptr(), M, N, V, nt):  # C loops: no bounds checks
        raise ValueError(f"ngram token ids must be in [0, {V})")
    Wc = W.to(torch.float32).contiguous()
    sc = None if scales is None else scales.to(torch.float32).contiguous()
    out = torch.empty(M, N - 1, R, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    rstd = torch.empty(M, N - 1 if use_norm else 0, dtype=torch.float32)
    lib.tn_lookup_forward(
        table.data_ptr(),
        idx.data_ptr(),
        Wc.data_ptr(),
        _ptr(sc),
        M,
        N,
        R,
        int(use_norm),
        float(eps),
        out.data_ptr(),
        _ptr(rstd),
        nt,
        int(out_bf16),
    )
    return out, rstd


c_lookup_fwd = torch.library.custom_op("tngram::c_lookup_fwd", mutates_args=())(lookup_forward)


@c_lookup_fwd.register_fake
def _(factors, idx, W, scales, use_norm, eps, out_bf16=False):  # noqa: ANN001, ANN202
    N, V, R = factors.shape
    M = idx.shape[0]
    return (
        factors.new_empty(M, N - 1, R, dtype=torch.bfloat16 if out_bf16 else torch.float32),
        factors.new_empty(M, N - 1 if use_norm else 0),
    )


@torch.library.custom_op("tngram::c_lookup_bwd", mutates_args=())
def c_lookup_bwd(
    grad: Tensor,
    factors: Tensor,
    idx: Tensor,
    W: Tensor,
    scales: Optional[Tensor],
    rstd: Tensor,
    need_factors: bool,
    need_W: bool,
    need_scales: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> d factors (N, V, R), dW (N-1, R), ds (N-1,); each empty when not needed.

    grad fp32, or bf16 (the gradient of a bf16 e): read as is and widened in C (exact)."""
    N, V, R = factors.shape
    M = idx.shape[0]
    g_bf16 = grad.dtype == torch.bfloat16
    g = grad.contiguous() if g_bf16 else grad.to(torch.float32).contiguous()
    d_f = torch.zeros(N, V, R, dtype=torch.float32) if need_factors else factors.new_empty(0)
    dW = torch.zeros(N - 1, R, dtype=torch.float32) if need_W else factors.new_empty(0)
    ds = (
        torch.zeros(N - 1, dtype=torch.float32)
        if (need_scales and scales is not None)
        else factors.new_empty(0)
    )
    sc = None if scales is None else scales.to(torch.float32).contiguous()
    _lib().tn_lookup_backward(
        g.data_ptr(),
        factors.contiguous().data_ptr(),
        idx.contiguous().data_ptr(),
        W.to(torch.float32).contiguous().data_ptr(),
        _ptr(sc),
        _ptr(rstd),
        M,
        N,
        R,
        _ptr(d_f),
        _ptr(dW),
        _ptr(ds),
        torch.get_num_threads(),
        int(g_bf16),
    )
    return d_f, dW, ds


@c_lookup_bwd.register_fake
def _(grad, factors, idx, W, scales, rstd, need_factors, need_W, need_scales):  # noqa: ANN001, ANN202
    N, V, R = factors.shape
    return (
        factors.new_empty(N, V, R) if need_factors else factors.new_empty(0),
        factors.new_empty(N - 1, R) if need_W else factors.new_empty(0),
        factors.new_empty(N - 1) if (need_scales and scales is not None) else factors.new_empty(0),
    )


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    factors, idx, W, scales, use_norm, eps = inputs[:6]
    ctx.save_for_backward(factors, idx, W, scales, output[1])


def _backward(ctx, grad_out, grad_rstd):  # noqa: ANN001, ANN202
    factors, idx, W, scales, rstd = ctx.saved_tensors
    need_f, _, need_W, need_s = ctx.needs_input_grad[:4]
    d_f, dW, ds = c_lookup_bwd(grad_out, factors, idx, W, scales, rstd, need_f, need_W, need_s)
    return (
        d_f if need_f else None,
        None,
        dW.to(W.dtype) if need_W else None,
        ds.to(scales.dtype) if (need_s and scales is not None) else None,
        None,
        None,
        None,
    )


c_lookup_fwd.register_autograd(_backward, setup_context=_setup_context)


def c_lookup(
    factors: Tensor,
    idx: Tensor,
    W: Tensor | None,
    scales: Tensor | None,
    use_norm: bool,
    eps: float,
    chunk: int = 0,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Same contract as `FusedTNGramLookup.apply(factors, idx, W, scales, use_norm, eps, chunk)`
    (chunk is ignored: the C loop works token by token). W None = no absorption (ones).
    out_dtype torch.bfloat16 returns e in bf16, bit-identical to casting the fp32 e (see
    c_lookup_fwd); None or fp32: fp32."""
    N, V, R = factors.shape
    if W is None:
        W = factors.new_ones(N - 1, R)
    if out_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"c_lookup out_dtype must be None, float32 or bfloat16, got {out_dtype}")
    # the op's dispatch costs more than a decoded token's lookup: an eager call without
    # autograd calls the function itself
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (factors, W, scales)
    )
    fwd = c_lookup_fwd if grad or torch.compiler.is_compiling() else lookup_forward
    return fwd(factors, idx, W, scales, use_norm, eps, out_dtype == torch.bfloat16)[0]


# dtypes it writes directly (fused_lookup's out_dtype); a function attribute, which mypy
# cannot see on a def
c_lookup.out_dtypes = (torch.bfloat16,)  # type: ignore[attr-defined]
