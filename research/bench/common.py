"""Shared benchmark helpers: interleaved timing with medians, machine facts, matmul peak, peak RSS.

Timings on a shared 2-core machine are noisy, so every benchmark (1) runs all candidates in one
process, (2) interleaves them (rep i of every candidate before rep i+1 of any), (3) discards
warm-up reps and reports the median (and the minimum, which is the least disturbed run), and
(4) records the load average before/after so a reader can judge the noise.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MALLOC_ENV = {  # glibc: keep freed heap memory instead of returning it to the kernel each step
    "MALLOC_MMAP_MAX_": "0",  # never serve large blocks with mmap (freed = unmapped)
    "MALLOC_TRIM_THRESHOLD_": "4294967296",  # never trim the heap top
    "MALLOC_TOP_PAD_": "268435456",  # grow the heap 256 MiB at a time
}


@dataclass
class Timing:
    """Per-candidate wall times in seconds (warm-up excluded)."""

    name: str
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def best(self) -> float:
        return min(self.times) if self.times else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.best, "reps": len(self.times)}


def interleaved(
    candidates: dict[str, Callable[[], Any]],
    reps: int,
    warmup: int,
    setup: Callable[[str], Any] | None = None,
) -> dict[str, Timing]:
    """Time every candidate `warmup + reps` times, interleaved; `setup(name)` runs untimed first."""
    out = {k: Timing(k) for k in candidates}
    for i in range(warmup + reps):
        for name, fn in candidates.items():
            if setup is not None:
                setup(name)
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                out[name].times.append(dt)
    return out


def loadavg() -> list[float]:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return []


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma")))
    except OSError:
        pass
    return []


def machine_info() -> dict[str, Any]:
    """What a reader needs to reproduce a figure: CPU, threads, torch, allocator env, load."""
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "flags": cpu_flags(),
        "malloc_env": {k: os.environ[k] for k in MALLOC_ENV if k in os.environ},
        "loadavg": loadavg(),
    }


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 11) -> float:
    """Peak FLOP/s of an n x n x n torch.mm in `dtype`: the best of `reps` after one warm-up (a
    peak is what the machine can do; a median under load understated it below a real step)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_delta_subprocess(
    module: str,
    func: str,
    args: dict[str, Any],
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> int | None:
    """Peak RSS increase of one call `module.func(**args)` in a fresh interpreter.

    The child builds its inputs, records VmHWM after setup, runs the measured call (which
    returns the setup RSS it saw), and reports peak-minus-setup. None if the child fails.
    """
    code = (
        f"import json, sys; from {module} import {func} as f; "
        f"print(json.dumps(f(**json.loads(sys.argv[1]))))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    try:
        return int(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return None


def vm_hwm_bytes() -> int:
    """Peak resident set size of this process so far (VmHWM)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return max_rss_bytes()


def vm_rss_bytes() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fmt_ms(seconds: float) -> str:
    return f"{1000 * seconds:8.2f}"


def fmt_si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def step_optimizers(
    net: torch.nn.Module, o: Any, memory_update: str, catchup: bool, fused: bool = False
) -> tuple[list[torch.optim.Optimizer], torch.optim.Optimizer | None]:
    """The trainer's optimisers for `net` under OptimConfig `o`, as the step benchmarks run them:
    Adam (fused when `fused`), Muon when the model has matrix groups, and the table optimiser of
    `memory_update` (setup_memory_update, which also switches the memories' gradients to
    row-sparse). Returns (every optimiser in step order, the table optimiser or None)."""
    from tngram.optim.groups import build_param_groups
    from tngram.optim.memory_update import setup_memory_update
    from tngram.optim.muon import Muon, muon_impl

    groups = build_param_groups(net, o)
    betas = (o.beta1, o.beta2)
    table_opt, rest = setup_memory_update(net, groups, memory_update, betas, o.adam_eps, catchup)
    adam = [g for g in rest if g["optimizer"] == "adam"]
    opts: list[torch.optim.Optimizer] = [
        torch.optim.Adam(adam, betas=betas, eps=o.adam_eps, **({"fused": True} if fused else {}))
    ]
    muon = [g for g in rest if g["optimizer"] == "muon"]
    if muon:
        dev = next(net.parameters()).device
        stack = muon_impl(dev) == "stacked"  # as the trainer: stacked by shape on CUDA
        opts.append(
            Muon(
                muon,
                lr=o.matrix_lr,
                momentum=o.muon_momentum,
                ns_steps=o.muon_ns_steps,
                stack_shapes=stack,
            )
        )
    if table_opt is not None:
        opts.append(table_opt)
    return opts, table_opt
