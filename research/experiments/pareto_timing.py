"""Timing of the pareto map's points (`python -m research experiment pareto`).

`bench_points`: one training step (forward, backward, Adam + Muon; the trainer's micro-batches
and accumulation, bf16 autocast as the mini recipes) and greedy decode per token with the
KV/memory cache, every (family, size) built in one process and timed interleaved (rep i of every
point before rep i + 1 of any), medians, at the thread count of the caller (the command sets 1).
`step_ratio`: one pair's step-time ratio in alternating rounds, with a distribution-free interval
(`median_ci`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Sequence


def bench_points(
    cfgs: dict[str, Any], reps: int = 5, warmup: int = 1, decode_tokens: int = 32
) -> dict[str, Any]:
    """{key: {"step_ms", "decode_ms_per_token"}} for each config, timed interleaved in this
    process."""
    import time
    from dataclasses import replace

    import torch
    from research.bench.common import interleaved, machine_info
    from research.bench.step import build_step_for
    from tngram.model.gpt import GPT

    steps = {
        k: build_step_for(c, "bf16" if c.run.dtype == "bf16" else "fp32")[0]
        for k, c in cfgs.items()
    }
    step_t = interleaved(steps, reps, warmup)
    del steps
    decoders: dict[str, Callable[[], Any]] = {}
    for k, c in cfgs.items():
        m = c.model
        if m.memory is not None and hasattr(m.memory, "zero_init_value"):
            m = replace(m, memory=replace(m.memory, zero_init_value=False))
        torch.manual_seed(0)
        model = GPT(m).eval()
        prompt = torch.randint(1, m.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

        def decode(model: Any = model, prompt: Any = prompt) -> None:
            cache: dict = {}
            with torch.no_grad():
                logits = model(prompt, cache=cache)
                for _ in range(decode_tokens):
                    logits = model(logits[:, -1:].argmax(-1), cache=cache)

        decoders[k] = decode
    dec_t = interleaved(decoders, reps, warmup)
    out = {
        k: {
            "step_ms": 1e3 * step_t[k].median,
            "decode_ms_per_token": 1e3 * dec_t[k].median / decode_tokens,
            "reps": reps,
        }
        for k in cfgs
    }
    return {
        "points": out,
        "machine": machine_info(),
        "timed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median of `xs`: the order statistics (k, n + 1 - k), k
    the largest with P(Binomial(n, 1/2) <= k - 1) <= (1 - level) / 2; (nan, nan) when n is too
    small."""
    n, xs = len(xs), sorted(xs)
    tail, k = 0.0, 0
    for j in range(n // 2 + 1):  # tail = P(B <= j), B ~ Binomial(n, 1/2)
        tail += math.comb(n, j) / 2**n
        if tail > (1 - level) / 2:
            break
        k = j + 1
    return (xs[k - 1], xs[n - k]) if k >= 1 else (math.nan, math.nan)


def _round_ratios(
    cfg_a: Any,
    cfg_b: Any,
    reps: int,
    warmup: int,
    b_first: bool = False,
    threads: int | None = None,
) -> list[float]:
    """Per-round step-time ratios a / b, alternating rounds (a then b, b then a, ...) in this
    process; b_first builds b's model and optimisers before a's."""
    import time

    import torch
    from research.bench.step import build_step_for

    if threads is not None:
        torch.set_num_threads(threads)
    order = (cfg_b, cfg_a) if b_first else (cfg_a, cfg_b)
    built = [build_step_for(c, "bf16" if c.run.dtype == "bf16" else "fp32")[0] for c in order]
    steps = built[::-1] if b_first else built  # steps[0] is a's
    ratios = []
    for i in range(warmup + reps):
        t = [0.0, 0.0]
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            steps[j]()
            t[j] = time.perf_counter() - t0
        if i >= warmup:
            ratios.append(t[0] / t[1])
    return ratios


def step_ratio(
    cfg_a: Any, cfg_b: Any, reps: int, warmup: int = 2, processes: int = 1
) -> dict[str, Any]:
    """Training step of cfg_a over cfg_b's, timed in alternating rounds (a then b, b then a, ...).

    processes=1: in this process at the caller's threads; the median of the per-round ratios and its
    95% interval (`median_ci`). processes=P > 1: P fresh processes one after another (spawned, at
    this process's thread count), the even ones building a first, the odd ones b first, `reps`
    rounds each; the ratio is the median of the per-process medians and the interval `median_ci`
    of those medians (for 6 <= P <= 8 their range; none below 6). Why: 16 fresh processes timing
    one pair (4.3 M) gave medians from 1.000 to 1.042, and some of their 95% intervals did not
    overlap ([0.997, 1.014] and [1.025, 1.045]; docs/LOG.md): the rounds of one process share
    something (its memory layout, say) that moves the ratio, so one process's interval
    understates the uncertainty."""
    from research.bench.common import loadavg

    if processes <= 1:
        ratios = _round_ratios(cfg_a, cfg_b, reps, warmup)
        lo, hi = median_ci(ratios)
        return {
            "ratio": statistics.median(ratios),
            "ci": [lo, hi],
            "rounds": reps,
            "loadavg": loadavg(),
        }
    import multiprocessing

    import torch

    ctx = multiprocessing.get_context("spawn")
    per: list[dict[str, Any]] = []
    for i in range(processes):
        with ctx.Pool(1) as pool:
            r = pool.apply(
                _round_ratios, (cfg_a, cfg_b, reps, warmup, i % 2 == 1, torch.get_num_threads())
            )
        per.append({"b_first": i % 2 == 1, "ratio": statistics.median(r), "rounds": r})
    meds = [p["ratio"] for p in per]
    lo, hi = median_ci(meds)
    return {
        "ratio": statistics.median(meds),
        "ci": [lo, hi],
        "rounds": reps,
        "processes": per,
        "loadavg": loadavg(),
    }
