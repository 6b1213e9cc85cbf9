"""`python -m research bench step`: one full training step (forward, backward, optimisers) per
recipe.

The step is the trainer's (tngram/train/loop.py): parameter groups from
`tngram.optim.groups.build_param_groups`, Adam for embeddings/tables/scalars and our Muon for
matrices, loss = model(x, y), fp32 or bf16 autocast on CPU. Inputs are random token ids (the
step's cost does not depend on the data). mini-* recipes run one optimiser step of their own
global batch, as the trainer does: micro-batches of 8 x 256 tokens, gradients accumulated over
2 of them (16 x 256), then Adam and Muon (at commit 49015ed and before: one micro-batch per
optimiser
step, which gave the optimisers twice the trainer's share of the step); paper-l9-* one
micro-batch of `paper_batch` x 1024 and fewer reps (one step takes seconds).

Analytic FLOPs per step = 6 x (matmul parameters) x tokens + 12 x L x d x T x tokens (attention
score and value matmuls, PaLM's convention, no causal discount). Matmul parameters are every
nn.Linear weight (attention, MLP, memory K/V, Over-Encoding projection) plus the tied head
(V x d); embedding/table/factor lookups and elementwise work are not counted, so the memory
models' extra gathers, products and gates show up as lower achieved FLOP/s. Achieved FLOP/s is
reported as a fraction of this machine's matmul peak measured in the same run (2048^3 torch.mm,
fp32 and bf16).

With `compile=True` every recipe/dtype is also measured with the model wrapped in
`torch.compile(dynamic=False)`, as the trainer does with `run.compile=true` (key suffix
"+compile"; the compile itself happens in the warm-up reps and is not timed).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch

from tngram.model.flops import matmul_params, train_flops
from research.bench.common import fmt_ms, fmt_si, interleaved, machine_info, matmul_peak

DEFAULT_RECIPES = (
    "mini-raw",
    "mini-engram",
    "mini-tngram",
    "paper-l9-raw",
    "paper-l9-engram",
    "paper-l9-tngram",
)


def build_step(
    recipe: str, dtype: str, paper_batch: int, compiled: bool = False
) -> tuple[Callable[[], None], dict[str, Any]]:
    """A closure doing one training step, and its analytic facts."""
    from tngram.train.recipes import get_recipe

    return build_step_for(
        get_recipe(recipe), dtype, paper_batch, compiled, mini=recipe.startswith("mini")
    )


def build_step_for(
    cfg: Any, dtype: str, paper_batch: int = 2, compiled: bool = False, mini: bool = True
) -> tuple[Callable[[], None], dict[str, Any]]:
    """build_step for a TrainConfig: `mini` runs the config's own global batch (micro-batches and
    accumulation as the trainer), else one micro-batch of `paper_batch` sequences."""
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups
    from tngram.optim.muon import Muon

    recipe = cfg.name
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model)
    o = cfg.optim
    groups = build_param_groups(model, o)
    adam = torch.optim.Adam(
        [g for g in groups if g["optimizer"] == "adam"], betas=(o.beta1, o.beta2), eps=o.adam_eps
    )
    opts: list[torch.optim.Optimizer] = [adam]
    muon_groups = [g for g in groups if g["optimizer"] == "muon"]
    if muon_groups:
        opts.append(
            Muon(
                muon_groups,
                lr=o.matrix_lr,
                momentum=o.muon_momentum,
                nesterov=True,
                ns_steps=o.muon_ns_steps,
            )
        )
    B = cfg.data.micro_batch_seqs if mini else paper_batch
    T = cfg.model.sequence_len
    V = cfg.model.vocab_size
    accum = max(1, cfg.data.global_batch_tokens // (B * T)) if mini else 1  # the trainer's
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(1, V, (accum, B, T + 1), generator=gen)
    batches = [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seq]
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bf16" else nullcontext
    fwd = torch.compile(model, dynamic=False) if compiled else model

    def step() -> None:
        for x, y in batches:
            with ctx():
                loss = fwd(x, y)
            (loss / accum).backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)

    tokens = accum * B * T
    m = cfg.model
    flops = train_flops(model, m.n_layer, m.n_embd, T, tokens)
    facts = {
        "recipe": recipe,
        "dtype": dtype,
        "compiled": compiled,
        "batch": B,
        "seq": T,
        "grad_accum": accum,
        "tokens": tokens,
        "params": model.num_params(),
        "matmul_params": matmul_params(model),
        "flops": float(flops),
        "optimizer": "Adam + Muon (tngram.optim.muon)",
    }
    return step, facts


def run(
    recipes: tuple[str, ...] = DEFAULT_RECIPES,
    reps: int = 8,
    warmup: int = 2,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    paper_batch: int = 2,
    profile: bool = False,
    compile: bool = False,
) -> dict[str, Any]:
    load_before = machine_info()["loadavg"]
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    results: dict[str, Any] = {}
    for group in ("mini", "paper"):
        names = [r for r in recipes if r.startswith("mini") == (group == "mini")]
        if not names:
            continue
        steps, facts = {}, {}
        for r in names:
            for dt in dtypes:
                for c in (False, True) if compile else (False,):
                    key = f"{r}:{dt}" + ("+compile" if c else "")
                    steps[key], facts[key] = build_step(r, dt, paper_batch, compiled=c)
        g_reps, g_warm = (reps, warmup) if group == "mini" else (max(2, reps // 3), 1)
        times = interleaved(steps, g_reps, g_warm)
        for key, t in times.items():
            f = facts[key]
            achieved = f["flops"] / t.median
            results[key] = {
                **f,
                "step": t.to_dict(),
                "tokens_per_s": f["tokens"] / t.median,
                "flops_per_s": achieved,
                "peak_fraction": achieved / peaks[f["dtype"]],
            }
        if profile and group == "mini":
            results["profile"] = {
                k: profile_step(steps[k]) for k in steps if not k.endswith("+compile")
            }
        del steps
    info = machine_info()
    info["loadavg_before"] = load_before
    return {
        "benchmark": "step",
        "machine": info,
        "matmul_peak_flops": peaks,
        "reps": reps,
        "warmup": warmup,
        "results": results,
        "targets": targets(results),
    }


def targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dt in ("fp32", "bf16", "fp32+compile", "bf16+compile"):
        raw, tn = results.get(f"mini-raw:{dt}"), results.get(f"mini-tngram:{dt}")
        if raw and tn:
            ratio = tn["flops_per_s"] / raw["flops_per_s"]
            out[f"mini tngram/raw FLOP/s ({dt})"] = {
                "ratio": ratio,
                "target": 0.95,
                "met": ratio >= 0.95,
            }
        if dt.startswith("bf16"):
            sfx = dt[4:]
            for name, r in (("mini-raw", raw), ("mini-tngram", tn)):
                if r:
                    out[f"{name}{sfx} share of bf16 peak"] = {
                        "fraction": r["peak_fraction"],
                        "target": 0.35,
                        "met": r["peak_fraction"] >= 0.35,
                    }
    return out


def profile_step(step: Callable[[], None], rows: int = 12) -> list[list[Any]]:
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return [[e.key, round(e.self_cpu_time_total / 3000, 2), e.count // 3] for e in ev]


def report(res: dict[str, Any]) -> str:
    mc, pk = res["machine"], res["matmul_peak_flops"]
    lines = [
        "python -m research bench step: forward + backward + Adam/Muon step, median (min) of the "
        "timed reps",
        f"machine: {mc['cpu']}, {mc['torch_threads']} torch threads, torch {mc['torch']}, load "
        f"{mc.get('loadavg_before')} -> {mc['loadavg']}, "
        f"malloc env {mc['malloc_env'] or 'default'}",
        f"matmul peak (2048^3 mm): fp32 {fmt_si(pk['fp32'], 'FLOP/s')}, bf16 "
        f"{fmt_si(pk['bf16'], 'FLOP/s')}",
        "",
        f"{'recipe:dtype':28s} {'tokens':>7s} {'step ms':>18s} {'tokens/s':>10s} {'FLOP/s':>13s} "
        f"{'of peak':>8s}",
    ]
    for key, r in res["results"].items():
        if key == "profile":
            continue
        lines.append(
            f"{key:28s} {r['tokens']:7d} {fmt_ms(r['step']['median_s'])} "
            f"({fmt_ms(r['step']['min_s']).strip():>7s})"
            f" {r['tokens_per_s']:10,.0f} {fmt_si(r['flops_per_s'], 'FLOP/s'):>13s} "
            f"{100 * r['peak_fraction']:7.1f}%"
        )
    lines.append("")
    for name, t in res["targets"].items():
        if "ratio" in t:
            lines.append(
                f"{name}: {t['ratio']:.3f} (target >= {t['target']}) -> "
                f"{'met' if t['met'] else 'NOT met'}"
            )
        else:
            lines.append(
                f"{name}: {100 * t['fraction']:.1f}% (target >= 35%) -> "
                f"{'met' if t['met'] else 'NOT met'}"
            )
    for key, ops in res["results"].get("profile", {}).items():
        lines.append(f"profile {key} (self CPU ms per step, calls):")
        lines.extend(f"    {op:40s} {ms:8.2f} {calls:6d}" for op, ms, calls in ops)
    return "\n".join(lines)
