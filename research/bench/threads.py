"""`python -m research bench threads`: TN-gram vs Engram at several thread counts, all in one
interleaved run.

Every candidate is (what, thread count): rep i of every candidate runs before rep i+1 of any,
and torch.set_num_threads(t) is applied untimed before each, so the 1- and 2-thread numbers
see the same machine load. Candidates per thread count t:

  lookup:engram@t, lookup:tngram@t   the lookup stage fwd+bwd at the paper-l9 shapes
                                      (research.bench.modules: d 512, V 1024, batch x seq tokens;
                                      TN-gram's lookup is the C kernel when it builds)
  module:engram@t, module:tngram@t   the whole memory module fwd+bwd
  step:mini-engram@t, step:mini-tngram@t   one optimiser step of the mini recipes as the demo
                                      trains (bf16 autocast, 2 accumulated micro-batches of
                                      8 x 256 tokens, Adam + Muon; research.bench.step)
  zero:V1024@t, zero:V8192@t         torch.zeros(5, V, 1024): the dense TN-gram factor-gradient
                                      fill of one paper-l9 layer at vocab 1024 and 8192

CPU time (time.process_time, all threads of the process) is recorded beside the wall time: on a
loaded machine a 1-thread candidate's CPU time is close to its undisturbed wall time (time spent
waiting for a core is not counted), so the 1-thread ratios are also given from CPU time. At 2
threads CPU time counts both threads, including OpenMP's spin-waiting.

From the 1- and 2-thread medians: speed-up S2 = T1 / T2 per candidate, and the Amdahl
projection to 16 cores, S16 = 1 / ((1 - p) + p / 16) with the parallel fraction p = 2 (1 - 1/S2)
implied by S2 (clipped to [0, 1]). The projection assumes every core gets the bandwidth one
core gets here; a real 16-core socket shares its memory channels, so it is an upper bound.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from research.bench.common import fmt_ms, interleaved, machine_info

if TYPE_CHECKING:
    from torch import nn

    from tngram.memory.tngram import TNGram


def amdahl_16(s2: float) -> tuple[float, float]:
    """(parallel fraction p, projected 16-core speed-up) from a measured 2-thread speed-up."""
    p = min(1.0, max(0.0, 2.0 * (1.0 - 1.0 / s2)))
    return p, 1.0 / ((1.0 - p) + p / 16.0)


def _with_cpu_time(fn: Callable[[], Any], sink: list[float]) -> Callable[[], Any]:
    """fn, also appending the process CPU time it took (time.process_time: all threads)."""

    def wrapped() -> Any:
        c0 = time.process_time()
        out = fn()
        sink.append(time.process_time() - c0)
        return out

    return wrapped


def run(
    threads: tuple[int, ...] = (1, 2),
    batch: int = 4,
    seq: int = 256,
    reps: int = 15,
    warmup: int = 3,
    steps: bool = True,
    zero: bool = True,
) -> dict[str, Any]:
    from research.bench import modules

    mods, h, work, facts = _workloads(batch, seq, steps, zero)
    cands = {f"{k}@{t}": fn for t in threads for k, fn in work.items()}
    rows, info = _time_interleaved(cands, mods, h, reps, warmup)
    out: dict[str, Any] = {
        "benchmark": "threads",
        "threads": list(threads),
        "machine": info,
        "shapes": {
            "batch": batch,
            "seq": seq,
            "tokens": batch * seq,
            "d_model": modules.D_MODEL,
            "vocab": modules.VOCAB,
        },
        "reps": reps,
        "warmup": warmup,
        "times": rows,
        "step_facts": facts,
    }
    ratios: dict[str, Any] = {}
    for t in threads:
        r = ratios[str(t)] = {}
        for part in ("lookup", "module"):
            r[part] = _tngram_over_engram(rows, f"{part}:{{}}@{t}", "median_s")
            r[f"{part}_min"] = _tngram_over_engram(rows, f"{part}:{{}}@{t}", "min_s")
        if steps:
            r["step"] = _tngram_over_engram(rows, f"step:mini-{{}}@{t}", "median_s")
    # analytic references from bench.modules (thread-independent)
    by = {n: modules.lookup_bytes(n, m, batch * seq)["mirror"] for n, m in mods.items()}
    fl = {n: modules.module_flops(n, m, batch * seq) for n, m in mods.items()}
    out["bytes_ratio"] = by["tngram"] / by["engram"]
    out["flop_ratio"] = fl["tngram"] / fl["engram"]
    out["ratios"] = ratios
    out["cpu_ratios"] = _cpu_ratios(rows, threads, steps)
    if 1 in threads and 2 in threads:
        out["speedups"] = _speedups(rows, list(work))
    return out


def _workloads(
    batch: int, seq: int, steps: bool, zero: bool
) -> tuple[dict[str, nn.Module], torch.Tensor, dict[str, Callable[[], Any]], dict[str, Any]]:
    """The memory modules, the hidden input h, the candidates' work (name -> fn, thread count
    not yet applied) and the optimiser steps' facts, from a fixed seed."""
    from research.bench import modules
    from research.bench.step import build_step

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, modules.VOCAB, (batch, seq), generator=gen)
    h = torch.randn(batch, seq, modules.D_MODEL, generator=gen).requires_grad_()
    mods: dict[str, nn.Module] = {}
    for n in ("engram", "tngram"):
        built = modules.build(n)
        assert built is not None  # only the candidate "none" has no module
        mods[n] = built
    g_vec = {
        n: torch.randn(batch, seq, modules.d_mem(n, m), generator=gen) for n, m in mods.items()
    }
    g_out = torch.randn(batch, seq, modules.D_MODEL, generator=gen)
    work: dict[str, Callable[[], Any]] = {}

    def lookup_backward(n: str, m: nn.Module) -> Callable[[], None]:
        return lambda: modules.lookup(n, m, ids).backward(g_vec[n])

    def module_backward(n: str, m: nn.Module) -> Callable[[], None]:
        return lambda: modules.module_forward(n, m, h, ids).backward(g_out)

    for n, m in mods.items():
        work[f"lookup:{n}"] = lookup_backward(n, m)
        work[f"module:{n}"] = module_backward(n, m)
    facts: dict[str, Any] = {}
    if steps:
        for recipe in ("mini-engram", "mini-tngram"):
            work[f"step:{recipe}"], facts[f"step:{recipe}"] = build_step(recipe, "bf16", 2)
    if zero:

        def zeros(V: int) -> Callable[[], Any]:
            return lambda: torch.zeros(5, V, 1024)

        for V in (1024, 8192):
            work[f"zero:V{V}"] = zeros(V)
    return mods, h, work, facts


def _time_interleaved(
    cands: dict[str, Callable[[], Any]],
    mods: dict[str, nn.Module],
    h: torch.Tensor,
    reps: int,
    warmup: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Time `cands` ("what@threads") interleaved, each under its thread count with no gradients
    left over: (name -> its times and CPU median, the machine's facts with the load before)."""

    def setup(name: str) -> None:
        torch.set_num_threads(int(name.rsplit("@", 1)[1]))
        h.grad = None
        for m in mods.values():
            for p in m.parameters():
                p.grad = None

    before = torch.get_num_threads()
    load_before = machine_info()["loadavg"]
    cpu: dict[str, list[float]] = {k: [] for k in cands}
    timed = {k: _with_cpu_time(fn, cpu[k]) for k, fn in cands.items()}
    try:
        times = interleaved(timed, reps, warmup, setup=setup)
    finally:
        torch.set_num_threads(before)
    info = machine_info()
    info["loadavg_before"] = load_before
    rows = {k: t.to_dict() for k, t in times.items()}
    for k, r in rows.items():  # CPU seconds of the process (all threads), warm-up reps dropped
        xs = sorted(cpu[k][warmup:])
        r["cpu_median_s"] = xs[len(xs) // 2] if xs else float("nan")
    return rows, info


def _tngram_over_engram(rows: dict[str, dict[str, Any]], key: str, field: str) -> float:
    """rows[key with tngram][field] / rows[key with engram][field]; `key` has one "{}"."""
    return rows[key.format("tngram")][field] / rows[key.format("engram")][field]


def _cpu_ratios(
    rows: dict[str, dict[str, Any]], threads: tuple[int, ...], steps: bool
) -> dict[str, Any]:
    """Per thread count: TN-gram / Engram of the CPU-time medians (lookup, module, step)."""
    cpu_ratios: dict[str, Any] = {}
    for t in threads:
        c = cpu_ratios[str(t)] = {}
        for part in ("lookup", "module"):
            c[part] = _tngram_over_engram(rows, f"{part}:{{}}@{t}", "cpu_median_s")
        if steps:
            c["step"] = _tngram_over_engram(rows, f"step:mini-{{}}@{t}", "cpu_median_s")
    return cpu_ratios


def _speedups(rows: dict[str, dict[str, Any]], work: list[str]) -> dict[str, Any]:
    """Per candidate: the 2-thread speed-up, its parallel fraction and Amdahl's 16 cores."""
    sp = {}
    for k in work:
        s2 = rows[f"{k}@1"]["median_s"] / rows[f"{k}@2"]["median_s"]
        p, s16 = amdahl_16(s2)
        sp[k] = {"speedup_2": s2, "parallel_fraction": p, "amdahl_16": s16}
    return sp


def report(res: dict[str, Any]) -> str:
    mc, sh = res["machine"], res["shapes"]
    lines = [
        f"python -m research bench threads: threads {res['threads']} interleaved in one process, "
        "median of "
        f"{res['reps']} after {res['warmup']} warm-up (min in brackets); lookup/module at "
        f"paper-l9 shapes, {sh['tokens']} tokens; steps = mini recipes, bf16 autocast",
        f"machine: {mc['cpu']}, torch {mc['torch']}, load {mc.get('loadavg_before')} -> "
        f"{mc['loadavg']}",
        "",
    ]
    keys = sorted({k.rsplit("@", 1)[0] for k in res["times"]})
    head = f"{'candidate':20s}" + "".join(
        f" {'@' + str(t) + ' ms (min) [cpu ms]':>30s}" for t in res["threads"]
    )
    if "speedups" in res:
        head += f" {'S2':>6s} {'p':>5s} {'16-core':>8s}"
    lines.append(head)
    for k in keys:
        line = f"{k:20s}"
        for t in res["threads"]:
            r = res["times"][f"{k}@{t}"]
            line += (
                f" {fmt_ms(r['median_s'])} ({fmt_ms(r['min_s']).strip():>7s})"
                f" [{fmt_ms(r['cpu_median_s']).strip():>7s}]"
            )
        if "speedups" in res:
            s = res["speedups"][k]
            line += f" {s['speedup_2']:6.2f} {s['parallel_fraction']:5.2f} {s['amdahl_16']:8.2f}"
        lines.append(line)
    lines.append("")
    lines.append(
        f"analytic: lookup bytes ratio TN-gram/Engram {res['bytes_ratio']:.2f}, "
        f"module FLOP ratio {res['flop_ratio']:.2f} (target <= {1.05 * res['flop_ratio']:.2f})"
    )
    for t, r in res["ratios"].items():
        s = (
            f"@{t} threads: lookup ratio {r['lookup']:.2f} (min {r['lookup_min']:.2f}) -> "
            f"{'met' if r['lookup'] <= res['bytes_ratio'] else 'NOT met'}; module ratio "
            f"{r['module']:.2f} (min {r['module_min']:.2f}) -> "
            f"{'met' if r['module'] <= 1.05 * res['flop_ratio'] else 'NOT met'}"
        )
        if "step" in r:
            met = "met" if r["step"] <= 1.10 else "NOT met"
            s += f"; mini step ratio {r['step']:.2f} -> {met} (<= 1.10)"
        lines.append(s)
        c = res["cpu_ratios"][t]
        lines.append(
            f"   from CPU time: lookup {c['lookup']:.2f}, module {c['module']:.2f}"
            + (f", mini step {c['step']:.2f}" if "step" in c else "")
        )
    if "speedups" in res:
        lines.append(
            "16-core: Amdahl from the measured 2-thread speed-up (an upper bound: memory "
            "bandwidth per core is assumed constant)"
        )
    return "\n".join(lines)


def kernel_share(batch: int = 4, seq: int = 256, reps: int = 25) -> dict[str, Any]:
    """At 1 thread: the share p of TN-gram's lookup fwd+bwd spent inside the two C custom ops
    (whose loops and gradient fill run on every thread), from the minimum of `reps` interleaved
    runs (the least disturbed). The rest (n-gram windows, row ids, W and s, autograd glue) runs on
    one thread. Amdahl: S(n) = 1 / ((1 - p) + p / n); memory bandwidth not modelled."""
    from research.bench import modules
    from tngram.kernels import absorption_weights, c_unavailable_reason, ngram_row_index
    from tngram.kernels.tngram_c import c_lookup_bwd, c_lookup_fwd
    from tngram.memory.ngrams import suffix_ngrams

    if c_unavailable_reason() is not None:
        return {"error": f"C kernel unavailable: {c_unavailable_reason()}"}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = cast("TNGram", modules.build("tngram"))
        c = m.config
        ids = torch.randint(
            1, modules.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1)
        )
        g_vec = torch.randn(batch, seq, modules.d_mem("tngram", m))
        N, V, R = m.factors.shape
        idx = ngram_row_index(suffix_ngrams(ids, N, c.pad_id), V)
        assert m.absorb is not None and m.log_scales is not None  # paper-l9's TN-gram has both
        with torch.no_grad():
            W = absorption_weights(m.absorb, N, R, m.absorb)
            s = torch.exp(m.log_scales)
            e, rstd = c_lookup_fwd(m.factors, idx, W, s, c.use_norm, c.norm_eps)
        g = g_vec.view(-1, N - 1, R)

        def whole() -> None:
            m.zero_grad(set_to_none=True)
            modules.lookup("tngram", m, ids).backward(g_vec)

        cands = {
            "whole": whole,
            "c_fwd": lambda: c_lookup_fwd(m.factors.detach(), idx, W, s, c.use_norm, c.norm_eps),
            "c_bwd": lambda: c_lookup_bwd(g, m.factors.detach(), idx, W, s, rstd, True, True, True),
        }
        times = interleaved(cands, reps, 3)
    finally:
        torch.set_num_threads(before)
    t = {k: v.best for k, v in times.items()}
    p = min(1.0, (t["c_fwd"] + t["c_bwd"]) / t["whole"])
    return {
        "min_s": t,
        "parallel_share": p,
        "amdahl": {n: 1.0 / ((1.0 - p) + p / n) for n in (2, 4, 8, 16, 64)},
        "loadavg": machine_info()["loadavg"],
    }
