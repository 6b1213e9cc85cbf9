"""`python -m research bench gpu --profile`: where one forward + backward step's time goes, by
kernel.

After an fwdbwd item's timing (its warm-up done, so nothing compiles here) PROFILE_STEPS more
steps run under torch.profiler (CPU activity, plus CUDA on CUDA; no shapes, stacks or memory,
to keep it cheap). The item gains a "profile" dict:

    steps       the steps profiled
    time        "device": self device time of the CUDA kernels, memcpys and memsets (CUDA);
                "cpu": self CPU time of every op (the CPU, where no device events exist)
    total_ms    that time summed over every kernel / op, per step
    wall_ms     wall-clock ms per profiled step (the profiler's own overhead included)
    categories  total_ms split by CATEGORIES (first match on the name, else "other")
    top         the TOP kernels / ops by that time: name (cut to NAME_CHARS), category, calls
                per step, ms per step, share of total_ms

On CUDA the CPU-side ops (aten::mm, tngram::triton_lookup_fwd, ...) are left out of the sums:
their device time is the kernels' time, counted once through the kernels themselves; so are
the profiler's device-side copies of record_function ranges ("user annotations").
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

PROFILE_STEPS = 3
TOP = 12
NAME_CHARS = 80
OTHER = "other"
# (category, pattern searched case-insensitively in a kernel's or op's name); the first match
# wins, so the order matters: the attention kernels' names contain "cutlass" / "sm80", and an
# inductor kernel's name may contain "mm" (e.g. triton_poi_fused_mm_view_3).
CATEGORIES: tuple[tuple[str, str], ...] = (
    # ours: the TN-gram lookup's Triton kernels (tngram/kernels/tngram_triton.py), the row-sparse
    # Adam update's (row_update_triton.py), their torch.library custom ops and the autograd nodes
    # of those ops (on the CPU the C lookup, tngram_c.py, shows as tngram::c_lookup_fwd / _bwd
    # and GeneratedBackwardFor_tngram_c_lookup_fwd_default), and the torch path's autograd
    # Function (FusedTNGramLookup, tngram_lookup.py: only its own time; the aten ops inside it
    # cannot be told from the model's other ops)
    (
        "lookup",
        r"^tngram::|tngram_(c|triton)_lookup|_tngram_(fwd|bwd|bwd_ws)_kernel|_row_adam_kernel"
        r"|FusedTNGramLookup",
    ),
    # flash / memory-efficient / cuDNN SDPA kernels (flash_fwd_kernel, fmha_cutlassF_*,
    # cudnn_*_sdpa_*) and their aten ops (aten::_scaled_dot_product_flash_attention, ...)
    ("attention", r"flash|sdpa|efficient_attention|fmha|scaled_dot_product|attention"),
    # inductor's generated Triton kernels: pointwise, reduction, persistent reduction, foreach;
    # on the CPU its C++ kernels (cpp_fused_* where named), which otherwise run inside the
    # "## Call CompiledFxGraph <hash> ##" range and are its self CPU time
    ("fused", r"^triton_(poi|red|per|for)_|^cpp_fused_|^## call compiledfxgraph"),
    # cuBLAS / cuBLASLt / CUTLASS kernels (sm90_xmma_gemm_*, nvjet_*, ampere_*gemm*, gemv2T_*,
    # cutlass::Kernel2<...>, splitKreduce_kernel), inductor's matmul templates, and the aten ops
    (
        "matmul",
        r"gemm|gemv|cutlass|cublas|nvjet|xmma|splitkreduce|ampere_|^triton_tem_"
        r"|^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm|mv|addmv|dot)$",
    ),
    ("memcpy/memset", r"memcpy|memset"),
)
_COMPILED = tuple((cat, re.compile(pat, re.IGNORECASE)) for cat, pat in CATEGORIES)


def category(name: str) -> str:
    """The category of a kernel or op name (CATEGORIES, first match), else OTHER."""
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return OTHER


def _cut(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def summarise(rows: Iterable[tuple[str, int, float]], steps: int, top: int = TOP) -> dict[str, Any]:
    """rows: (name, calls, self µs) over `steps` steps, one row per name -> the per-step totals,
    the category sums (every category, zeros included) and the `top` rows by time."""
    rows = [(n, c, us) for n, c, us in rows if us > 0]
    total_us = sum(us for _, _, us in rows)
    cats = {cat: 0.0 for cat, _ in CATEGORIES} | {OTHER: 0.0}
    for name, _, us in rows:
        cats[category(name)] += us
    ranked = sorted(rows, key=lambda r: (-r[2], r[0]))[:top]

    def ms(us: float) -> float:
        return round(us / 1e3 / steps, 4)

    return {
        "steps": steps,
        "total_ms": ms(total_us),
        "categories": {cat: ms(us) for cat, us in cats.items()},
        "top": [
            {
                "name": _cut(name),
                "category": category(name),
                "calls": round(calls / steps, 2),
                "ms": ms(us),
                "share": round(us / total_us, 4) if total_us else 0.0,
            }
            for name, calls, us in ranked
        ],
    }


def event_rows(events: Iterable[Any], dev: str) -> list[tuple[str, int, float]]:
    """(name, calls, self µs) of torch.profiler's key_averages(): on CUDA the device events
    (kernels, memcpy, memset; not the device copies of user annotations) by self device time,
    on the CPU every op by self CPU time."""
    from torch.autograd import DeviceType

    # not by name: inductor also records each Triton kernel's launch on the CPU under the kernel's
    # own name, so a device event named like a CPU event can be a real kernel
    out = []
    for e in events:
        on_cpu = e.device_type == DeviceType.CPU
        if dev == "cuda":
            if on_cpu or getattr(e, "is_user_annotation", False):
                continue
            us = float(e.self_device_time_total)
        else:
            if not on_cpu:
                continue
            us = float(e.self_cpu_time_total)
        out.append((str(e.key), int(e.count), us))
    return out


def profile_steps(step: Callable[[], None], dev: str, steps: int = PROFILE_STEPS) -> dict[str, Any]:
    """Run step() `steps` times under torch.profiler and summarise(): see the module docstring.
    A profiler failure is returned as {"error": ...} (the item keeps its timing)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    try:
        # torch 2.11 (the card's) warns on every profile() that events of earlier cycles are
        # dropped; this profile has one cycle, so the warning says nothing here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            prof = profile(activities=acts, record_shapes=False, with_stack=False)
            prof.start()
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if dev == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        finally:
            prof.stop()
        rows = event_rows(prof.key_averages(), dev)
    except Exception as e:  # CUPTI missing or busy: the timing stands without a profile
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    return {
        "time": "device" if dev == "cuda" else "cpu",
        "wall_ms": round(wall * 1e3 / steps, 3),
        **summarise(rows, steps),
    }
