"""`python -m research bench trainer`: where a real training run's time goes, and how much of
TN-gram's step
gap to Engram is the extra matmul arithmetic.

phases: runs `tngram.train.loop.train` itself (the recipe, its data, `--stop-after` optimiser steps
of
its schedule, a throw-away run folder) with wall-clock timers around its pieces: data
(TokenLoader.next_batch), forward (GPT.forward outside evaluation), backward (Tensor.backward),
Adam and Muon steps, zero_grad, evaluation, checkpoint and final-weight writes, metrics and
progress. The timers wrap the classes' methods for the duration of the run only. "other in step"
is the trainer's timed step (what tokens/s divides by) minus the timed pieces inside it: loss
sync, schedules, health check. Everything outside the timed step (setup, evaluation, checkpoints)
does not enter tokens/s.

gap: in one process, interleaved, medians: the trainer's optimiser step of two recipes
(research.bench.step.build_step: bf16 autocast, the recipe's gradient accumulation) and, alone,
the memory K/V matmuls and the Muon Newton-Schulz iterations of their K/V matrices at the same
shapes, so the step gap can be split into "extra matmul arithmetic" and "the rest":

    K/V matmuls per step = layers x micro-steps x {e W^T + b (fwd), g W (d e), g^T e (d W)}
        e (tokens, E) bf16, W (2D, E): E = (N-1) R for TN-gram, (N-1) x heads x d_head for Engram
        FLOPs = layers x micro x 3 x 2 x tokens x E x 2D
    Muon NS per step = 2 x layers matrices (D, E), 5 steps of A = X X^T, B = bA + cA^2, X = aX + BX
        FLOPs = 2 layers x 5 x (4 D^2 E + 2 D^3)
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch
import torch.nn.functional as F

from research.bench.common import interleaved, machine_info

if TYPE_CHECKING:
    from tngram.memory.gating import GatedFusion

PHASES = ("data", "forward", "backward", "adam", "muon", "zero_grad")
OUTSIDE = ("eval", "checkpoint", "final_weights", "log", "progress")


@contextmanager
def _timers() -> Iterator[dict[str, list[float]]]:
    """Wall time per call of the trainer's pieces, recorded while the context is open."""
    from tngram.data.loader import TokenLoader
    from tngram.model.gpt import GPT
    from tngram.optim.muon import Muon
    from tngram.train import checkpoint as ckpt
    from tngram.train import loop
    from tngram.train.metrics import MetricsLog, Progress

    times: dict[str, list[float]] = defaultdict(list)
    in_eval = [False]
    saved: list[tuple[Any, str, Any]] = []

    def wrap(
        owner: Any, name: str, label: str, eval_flag: bool = False, skip_in_eval: bool = False
    ) -> None:
        f = getattr(owner, name)
        saved.append((owner, name, f))

        def timed(*a: Any, **k: Any) -> Any:
            if skip_in_eval and in_eval[0]:
                return f(*a, **k)
            in_eval[0] = in_eval[0] or eval_flag
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                times[label].append(time.perf_counter() - t0)
                if eval_flag:
                    in_eval[0] = False

        setattr(owner, name, timed)

    wrap(TokenLoader, "next_batch", "data")
    wrap(GPT, "forward", "forward", skip_in_eval=True)
    wrap(torch.Tensor, "backward", "backward")
    wrap(torch.optim.Adam, "step", "adam")
    wrap(Muon, "step", "muon")
    wrap(torch.nn.Module, "zero_grad", "zero_grad")
    wrap(loop, "evaluate_bpb", "eval", eval_flag=True)
    wrap(loop, "save_step_checkpoint", "checkpoint")  # the loop's call (usual files or FSDP shards)
    wrap(ckpt, "save_final_weights", "final_weights")
    wrap(MetricsLog, "log", "log")
    wrap(Progress, "update", "progress")
    try:
        yield times
    finally:
        for owner, name, f in reversed(saved):
            setattr(owner, name, f)


def phases(recipe: str, steps: int, threads: int, data: str | None = None) -> dict[str, Any]:
    """One real training run of `steps` optimiser steps, split into PHASES and OUTSIDE (seconds)."""
    from tngram.train.recipes import get_recipe

    cfg = get_recipe(recipe)
    cfg = replace(
        cfg,
        run=replace(cfg.run, threads=threads),
        data=replace(cfg.data, dir=data) if data else cfg.data,
    )
    return phases_of_config(cfg, steps)


def phases_of_config(cfg: Any, steps: int) -> dict[str, Any]:
    """`phases` for a TrainConfig; also the call counts of every timed piece."""
    from tngram.train.loop import train

    recipe = cfg.name
    out = Path(tempfile.mkdtemp(prefix="tngram-bench-trainer-"))
    try:
        with _timers() as times:
            t0 = time.perf_counter()
            summary = train(cfg, out / "run", max_steps=steps, progress=False)
            wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    inside = {k: sum(times.get(k, [])) for k in PHASES}
    res = {
        "recipe": recipe,
        "steps": steps,
        "threads": cfg.run.threads or torch.get_num_threads(),
        "wall_s": wall,
        "train_time_s": summary["train_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "in_step_s": inside,
        "other_in_step_s": summary["train_time_s"] - sum(inside.values()),
        "outside_step_s": {k: sum(times.get(k, [])) for k in OUTSIDE},
        "first_call_s": {k: v[0] for k, v in times.items() if v},
        "calls": {k: len(v) for k, v in times.items()},
    }
    res["setup_and_rest_s"] = wall - summary["train_time_s"] - sum(res["outside_step_s"].values())
    return res


def _kv_matmuls(E: int, D: int, tokens: int, calls: int) -> tuple[Callable[[], None], float]:
    g = torch.Generator().manual_seed(0)
    e = torch.randn(tokens, E, generator=g).bfloat16()
    w = (0.02 * torch.randn(2 * D, E, generator=g)).bfloat16()
    b = torch.zeros(2 * D).bfloat16()
    gy = torch.randn(tokens, 2 * D, generator=g).bfloat16()

    def run() -> None:
        for _ in range(calls):
            F.linear(e, w, b)  # forward (autocast runs the same bf16 linear)
            gy @ w  # d e
            gy.t() @ e  # d W

    return run, float(calls * 3 * 2 * tokens * E * 2 * D)


def _muon_ns(E: int, D: int, matrices: int, ns_steps: int) -> tuple[Callable[[], None], float]:
    from tngram.optim.muon import muon_scale, zeropower_newton_schulz

    g = torch.Generator().manual_seed(0)
    Ws = [torch.randn(D, E, generator=g) for _ in range(matrices)]

    def run() -> None:
        for W in Ws:
            zeropower_newton_schulz(W, ns_steps) * muon_scale(W.shape)

    s, l = min(D, E), max(D, E)
    return run, float(matrices * ns_steps * (4 * s * s * l + 2 * s**3))


def memory_width(recipe: str) -> tuple[int, int, int]:
    """(E, D, memory layers) of a recipe's memory K/V projections (E = their input width)."""
    from tngram.train.recipes import build_model

    with torch.device("meta"):
        model = build_model(recipe)
    fusions = [cast("GatedFusion", m) for m in model.modules() if type(m).__name__ == "GatedFusion"]
    return fusions[0].d_mem, fusions[0].d_model, len(fusions)


def gap(
    recipes: tuple[str, str] = ("mini-tngram", "mini-engram"), reps: int = 11, warmup: int = 2
) -> dict[str, Any]:
    """Step times of two recipes and of their K/V matmuls and Muon NS alone, interleaved."""
    from research.bench.step import build_step
    from tngram.train.recipes import get_recipe

    work: dict[str, Callable[[], None]] = {}
    flops: dict[str, float] = {}
    facts: dict[str, Any] = {}
    for r in recipes:
        cfg = get_recipe(r)
        E, D, layers = memory_width(r)
        work[f"step {r}"], f = build_step(r, "bf16", 1)
        tokens_micro = f["tokens"] // f["grad_accum"]
        work[f"kv {r}"], flops[f"kv {r}"] = _kv_matmuls(
            E, D, tokens_micro, layers * f["grad_accum"]
        )
        work[f"ns {r}"], flops[f"ns {r}"] = _muon_ns(E, D, 2 * layers, cfg.optim.muon_ns_steps)
        facts[r] = {
            "E": E,
            "D": D,
            "memory_layers": layers,
            "grad_accum": f["grad_accum"],
            "tokens": f["tokens"],
        }
    times = interleaved(work, reps, warmup)
    med = {k: t.median for k, t in times.items()}
    a, b = recipes
    step_gap = med[f"step {a}"] - med[f"step {b}"]
    arith_gap = (med[f"kv {a}"] - med[f"kv {b}"]) + (med[f"ns {a}"] - med[f"ns {b}"])
    rest_a = med[f"step {a}"] - med[f"kv {a}"] - med[f"ns {a}"]
    rest_b = med[f"step {b}"] - med[f"kv {b}"] - med[f"ns {b}"]
    return {
        "benchmark": "trainer-gap",
        "machine": machine_info(),
        "reps": reps,
        "warmup": warmup,
        "facts": facts,
        "times": {k: t.to_dict() for k, t in times.items()},
        "flops": flops,
        "step_ratio": med[f"step {a}"] / med[f"step {b}"],
        "step_gap_s": step_gap,
        "matmul_gap_s": arith_gap,
        "matmul_share_of_gap": arith_gap / step_gap if step_gap > 0 else float("nan"),
        "ratio_without_matmuls": rest_a / rest_b,
        "ratio_if_rest_were_equal": (med[f"step {b}"] + arith_gap) / med[f"step {b}"],
    }


def report_phases(rows: list[dict[str, Any]]) -> str:
    lines = [
        "python -m research bench trainer: one real training run per recipe, ms per optimiser step "
        "(first step included)",
        "",
    ]
    names = [r["recipe"] for r in rows]
    lines.append(f"{'piece':26s}" + "".join(f"{n:>14s}" for n in names))

    def row(label: str, vals: list[float]) -> None:
        lines.append(f"{label:26s}" + "".join(f"{v:14.1f}" for v in vals))

    for k in PHASES:
        row(k, [1e3 * r["in_step_s"][k] / r["steps"] for r in rows])
    row("other in step", [1e3 * r["other_in_step_s"] / r["steps"] for r in rows])
    row("= timed step", [1e3 * r["train_time_s"] / r["steps"] for r in rows])
    for k in OUTSIDE:
        row(f"(outside) {k}", [1e3 * r["outside_step_s"][k] / r["steps"] for r in rows])
    row("(outside) setup and rest", [1e3 * r["setup_and_rest_s"] / r["steps"] for r in rows])
    lines.append(f"{'tokens/s':26s}" + "".join(f"{r['tokens_per_s']:14,.0f}" for r in rows))
    return "\n".join(lines)


def report_gap(res: dict[str, Any]) -> str:
    mc = res["machine"]
    lines = [
        f"python -m research bench trainer --gap: median (min) ms of {res['reps']} interleaved "
        "reps, "
        f"{mc['torch_threads']} thread(s), load {mc['loadavg']}"
    ]
    for k, t in res["times"].items():
        fl = res["flops"].get(k)
        extra = f"  {fl / t['median_s'] / 1e9:7.1f} GFLOP/s" if fl else ""
        lines.append(f"  {k:22s} {1e3 * t['median_s']:9.1f} ({1e3 * t['min_s']:.1f}){extra}")
    lines.append(
        f"step ratio {res['step_ratio']:.3f}; gap {1e3 * res['step_gap_s']:.1f} ms, of which extra "
        f"K/V matmuls + Muon NS {1e3 * res['matmul_gap_s']:.1f} ms "
        f"({100 * res['matmul_share_of_gap']:.0f}%); ratio without them "
        f"{res['ratio_without_matmuls']:.3f}; ratio if everything else cost the same "
        f"{res['ratio_if_rest_were_equal']:.3f}"
    )
    return "\n".join(lines)
