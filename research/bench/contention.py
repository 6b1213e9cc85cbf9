"""`python -m research bench contention`: training tokens/s alone and beside a competing 2-thread
torch job.

One process, every candidate interleaved (rep i of every candidate before rep i+1 of any):

  condition  idle   the competitor is stopped (SIGSTOP)
             busy   the competitor runs (SIGCONT, then `settle_s` untimed so it is on the cores)
  threads    default  torch's default thread count at start (what `tngram train` used before
                      the automatic choice, and still uses on an idle machine)
             1        one thread
             auto     what `tngram train` chooses now (tngram.cpu.auto_threads: a /proc/stat
                      sample taken untimed before the rep, under the same condition)

The competitor is a separate process at the same priority (nice 0): torch.set_num_threads(2)
and 512 x 512 fp32 matmuls in a loop, as a second training job or a test suite would be. The
work timed is `steps` optimiser steps of a recipe exactly as the trainer does them
(research.bench.step: the recipe's global batch, micro-batches, accumulation, Adam + Muon, bf16
autocast for the mini recipes); tokens/s = tokens per step x steps / wall time.

What the machine was doing besides (other processes' busy CPUs at normal priority and niced,
from /proc/stat, and the load average) is sampled before and after and stored with the
results: numbers taken beside other jobs are not an idle measurement, and the results file
says so (`note`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import torch

from research.bench.common import machine_info

COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads({threads})\n"
    "a = torch.randn(512, 512)\n"
    "while True:\n"
    "    a = a @ a\n"
    "    a = a / a.norm()\n"
)
CONDITIONS = ("idle", "busy")
POLICIES = ("default", "1", "auto")


def _facts() -> dict[str, Any]:
    from dataclasses import asdict

    from tngram.cpu import read_cpu_facts

    return asdict(read_cpu_facts(1.0))


def run(
    recipe: str = "mini-tngram",
    reps: int = 5,
    warmup: int = 1,
    steps: int = 2,
    competitor_threads: int = 2,
    settle_s: float = 1.0,
) -> dict[str, Any]:
    from research.bench.step import build_step
    from tngram.cpu import auto_threads

    default = torch.get_num_threads()
    before = _facts()  # before the competitor exists
    step, facts = build_step(recipe, "bf16" if recipe.startswith("mini") else "fp32", 2)
    comp = subprocess.Popen(
        [sys.executable, "-c", COMPETITOR.format(threads=competitor_threads)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tps: dict[str, list[float]] = {f"{c}:{p}": [] for c in CONDITIONS for p in POLICIES}
    cpu_s: dict[str, list[float]] = {k: [] for k in tps}
    chosen: dict[str, list[int]] = {c: [] for c in CONDITIONS}
    try:
        time.sleep(2.0)  # the competitor imports torch before it is paused
        for i in range(warmup + reps):
            for cond in CONDITIONS:
                comp.send_signal(signal.SIGCONT if cond == "busy" else signal.SIGSTOP)
                time.sleep(settle_s)
                for pol in POLICIES:
                    if pol == "auto":
                        n = auto_threads(default).threads
                        chosen[cond].append(n)
                    else:
                        n = default if pol == "default" else int(pol)
                    torch.set_num_threads(n)
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(steps):
                        step()
                    dt, dc = time.perf_counter() - t0, time.process_time() - c0
                    if i >= warmup:
                        tps[f"{cond}:{pol}"].append(facts["tokens"] * steps / dt)
                        cpu_s[f"{cond}:{pol}"].append(dc / steps)
    finally:
        torch.set_num_threads(default)
        comp.send_signal(signal.SIGCONT)
        comp.kill()
        comp.wait()
    after = _facts()
    med, rel = summarize(tps)
    out: dict[str, Any] = {
        "benchmark": "contention",
        "recipe": recipe,
        "tokens_per_step": facts["tokens"],
        "steps_per_rep": steps,
        "reps": reps,
        "warmup": warmup,
        "default_threads": default,
        "competitor": f"{competitor_threads}-thread torch job (512x512 fp32 matmuls), nice 0",
        "tokens_per_s": tps,
        "median_tokens_per_s": med,
        "cpu_s_per_step": {k: sorted(v)[len(v) // 2] for k, v in cpu_s.items()},
        "vs_idle_default": rel,
        "auto_chose": chosen,
        "facts_before": before,
        "facts_after": after,
        "machine": machine_info(),
    }
    out["machine"]["loadavg_before"] = (
        [round(before["loadavg"], 2)] if before.get("loadavg") is not None else None
    )
    out["background"] = background_note(before, after)
    return out


def summarize(tps: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Median tokens/s per candidate ("condition:policy") and its ratio to idle:default."""
    import statistics

    med = {k: statistics.median(v) for k, v in tps.items()}
    return med, {k: v / med["idle:default"] for k, v in med.items()}


def background_note(before: dict[str, Any], after: dict[str, Any]) -> str:
    """ "" when nothing else ran; else what did (the numbers are then not an idle measurement)."""
    busy = max(before["others_busy"], after["others_busy"])
    niced = max(before["others_niced"], after["others_niced"])
    parts = []
    if busy >= 0.1:
        parts.append(f"other jobs at normal priority kept up to {busy:.1f} CPUs busy")
    if niced >= 0.1:
        parts.append(f"niced jobs up to {niced:.1f} CPUs")
    return "; ".join(parts)


def report(res: dict[str, Any]) -> str:
    lines = [
        f"python -m research bench contention: {res['recipe']}, {res['steps_per_rep']} steps of "
        f"{res['tokens_per_step']} tokens per rep, median of {res['reps']} after {res['warmup']} "
        f"warm-up, all candidates interleaved; competitor: {res['competitor']}",
        f"default threads {res['default_threads']}; auto chose idle {res['auto_chose']['idle']}, "
        f"busy {res['auto_chose']['busy']}",
        f"besides: {res['background'] or 'nothing (idle machine)'}",
        "",
        f"{'condition':10s} {'threads':>8s} {'tokens/s':>10s} {'x idle default':>15s}",
    ]
    for k, v in res["median_tokens_per_s"].items():
        cond, pol = k.split(":")
        lines.append(f"{cond:10s} {pol:>8s} {v:10,.0f} {res['vs_idle_default'][k]:15.2f}")
    return "\n".join(lines)
