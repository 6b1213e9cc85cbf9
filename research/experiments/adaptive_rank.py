"""`python -m research experiment adaptive-rank`: fixed CP ranks against one run that picks its own
rank.

    fixed      TN-gram at R in FIXED_RANKS (default 32 .. 704), one run per R and seed
    adaptive   TN-gram started at R = START_RANK; after optimiser step prune_at_step (100/256 of
               the schedule) every memory layer keeps the fewest rank-1 components holding
               (1 - PRUNE_TOL) of their energy (tngram.memory.cp_rank) and continues at that rank

Goal (checked in the report): the adaptive run's mean val loss is within GOAL_NATS of the best
fixed R's, at <= GOAL_PARAMS of that R's Δparams, in <= GOAL_TIME x its training time.
Δparams of an adaptive run are those of the final, pruned model (summary.json).

Training times of runs made one after another on a shared, loaded machine are noisy, so the
report also times one optimiser step of each variant's final shapes with the candidates
interleaved in one process (step_times) and estimates the adaptive run's time from it:
(prune_at_step x t(start rank) + remaining steps x t(picked ranks)) / steps.

Runs go in priority order (per seed: adaptive, then 704, 352, 128, 512, 256, 64, 32), so a
partial sweep (`--ranks`, fewer `--seeds`) still gives the comparison that matters most, and a
later full sweep reuses every finished run.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import TngramError, atomic_write_text, print0
from research.experiments.common import (
    SCALES,
    base_recipe,
    default_nproc,
    resolve_data,
    with_data,
    with_memory,
    with_seed,
    with_steps,
)
from tngram.experiments.runner import RunSpec, run_all
from research.report.plots import fmt_pm
from tngram.report.runs import mean_std
from tngram.train.config import TrainConfig

FIXED_RANKS = (32, 64, 128, 256, 352, 512, 704)
PRIORITY = (704, 352, 128, 512, 256, 64, 32)
START_RANK = 704
PRUNE_FRACTION = 100 / 256  # prune after this share of the schedule (step 100 of the mini 256)
PRUNE_TOL = 0.1  # chosen before any run; not tuned (docs/LOG.md)
MIN_CP_RANK = 8
GOAL_NATS, GOAL_PARAMS, GOAL_TIME = 0.005, 0.60, 1.2


def adaptive_specs(
    prefix: str,
    data_dir: str,
    vocab: int,
    seeds: int,
    steps: int | None,
    ranks: tuple[int, ...] = FIXED_RANKS,
    adaptive: bool = True,
) -> list[RunSpec]:
    """One RunSpec per (variant, seed), in priority order (see the module docstring)."""
    bad = [r for r in ranks if r < 1]
    if bad:
        raise TngramError(f"--ranks must be positive CP ranks, got {bad}")
    order = [r for r in PRIORITY if r in ranks] + sorted(r for r in ranks if r not in PRIORITY)
    specs = []
    for s in range(seeds):
        base = with_steps(
            with_seed(with_data(base_recipe(prefix, "tngram"), data_dir, vocab), s), steps
        )
        if adaptive:
            at = max(1, round(base.schedule.steps * PRUNE_FRACTION))
            cfg = with_memory(
                base,
                cp_rank=START_RANK,
                prune_at_step=at,
                prune_energy_tol=PRUNE_TOL,
                min_cp_rank=MIN_CP_RANK,
            )
            specs.append(
                RunSpec(
                    f"adaptive-R{START_RANK}-s{s}",
                    cfg,
                    {
                        "variant": "adaptive",
                        "seed": cfg.run.seed,
                        "start_rank": START_RANK,
                        "prune_at_step": at,
                    },
                )
            )
        for r in order:
            cfg = with_memory(base, cp_rank=r)
            specs.append(
                RunSpec(
                    f"fixed-R{r}-s{s}",
                    cfg,
                    {"variant": "fixed", "seed": cfg.run.seed, "start_rank": r},
                )
            )
    return specs


def _train_step(cfg: TrainConfig, ranks: tuple[int, ...]):
    """A closure running one optimiser step (all micro-steps, Adam + Muon) of cfg's model with its
    TN-gram layers at `ranks` (one per memory layer), on fixed random tokens."""
    import torch

    from tngram.memory.cp_rank import prune_tngram, tngram_modules
    from tngram.model.gpt import GPT
    from tngram.optim.groups import build_param_groups
    from tngram.optim.muon import Muon

    start = max(ranks)
    torch.manual_seed(cfg.run.seed)
    model = GPT(
        replace(cfg.model, memory=replace(cfg.model.memory, cp_rank=start, prune_at_step=0))
    )
    mods = tngram_modules(model)
    if len(mods) != len(ranks):
        raise TngramError(f"{len(ranks)} ranks given for {len(mods)} TN-gram layers")
    for (_, m), r in zip(mods, ranks):
        if r < start:
            prune_tngram(m, torch.arange(r), correct_scales=False)
    o = cfg.optim
    groups = build_param_groups(model, o)
    opts = [
        torch.optim.Adam(
            [g for g in groups if g["optimizer"] == "adam"],
            betas=(o.beta1, o.beta2),
            eps=o.adam_eps,
        ),
        Muon(
            [g for g in groups if g["optimizer"] == "muon"],
            lr=o.matrix_lr,
            momentum=o.muon_momentum,
        ),
    ]
    B, T = cfg.data.micro_batch_seqs, cfg.model.sequence_len
    accum = max(1, cfg.data.global_batch_tokens // (B * T))
    seq = torch.randint(
        1, cfg.model.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)
    )
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    amp = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if cfg.run.dtype == "bf16"
        else nullcontext
    )

    def step() -> None:
        for _ in range(accum):
            with amp():
                loss = model(x, y)
            (loss / accum).backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)

    return step


def step_times(
    cfg: TrainConfig, variants: dict[str, tuple[int, ...]], reps: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per optimiser step of each variant (per-layer ranks), interleaved."""
    steps = {k: _train_step(cfg, r) for k, r in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(warmup + reps):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def timing_section(cfg: TrainConfig, rows: list[dict[str, Any]], reps: int = 5) -> str:
    """Interleaved step times of the fixed ranks run and of each adaptive run's picked ranks,
    and the adaptive runs' estimated time relative to the best fixed R."""
    import torch

    n_layers = len(cfg.model.memory_layers)
    fixed = sorted({int(r["start_rank"]) for r in rows if r["variant"] == "fixed"})
    adapt = [r for r in rows if r["variant"] == "adaptive"]
    if not fixed or not adapt:
        return ""
    variants = {f"fixed R={R}": (R,) * n_layers for R in fixed}
    start = int(adapt[0]["start_rank"])
    variants.setdefault(f"fixed R={start}", (start,) * n_layers)
    for r in adapt:
        variants[f"adaptive seed {r['seed']} after pruning"] = tuple(_final_ranks(r))
    t = step_times(cfg, variants, reps=reps)
    best = min(
        fixed,
        key=lambda R: mean_std(
            [r["val_loss"] for r in rows if r["variant"] == "fixed" and int(r["start_rank"]) == R]
        )[0],
    )
    tb = t[f"fixed R={best}"]
    lines = [
        f"Step time (one optimiser step, median of {reps} interleaved repetitions, "
        f"{torch.get_num_threads()} thread(s)):",
        "",
        "| variant | ranks | s/step | vs best fixed R |",
        "|---|---|---|---|",
    ]
    for k, v in variants.items():
        lines.append(f"| {k} | {', '.join(map(str, v))} | {t[k]:.3f} | {t[k] / tb:.2f}x |")
    S = cfg.schedule.steps
    ests = []
    for r in adapt:
        p = int(r["prune_at_step"])
        est = (
            p * t[f"fixed R={start}"] + (S - p) * t[f"adaptive seed {r['seed']} after pruning"]
        ) / S
        ests.append(est / tb)
    lines += [
        "",
        f"Estimated adaptive training time from these step times ((p t_{start} + (S - p) t_picked) "
        f"/ S, "
        f"S = {S}): {', '.join(f'{e:.2f}x' for e in ests)} of fixed R = {best} "
        f"(goal <= {GOAL_TIME}x): {'met' if max(ests) <= GOAL_TIME else 'NOT met'}",
    ]
    return "\n".join(lines)


def pruning_effect(
    checkpoint: Path,
    cfg: TrainConfig,
    data_dir: str,
    tols: tuple[float, ...] = (PRUNE_TOL,),
    val_tokens: int = 65_536,
) -> list[dict[str, Any]]:
    """Immediate effect of pruning a checkpoint (no further training): val loss before, and after
    pruning at each tolerance with and without the log-scale correction, with the ranks kept."""
    import torch

    from tngram.data.bpb import token_byte_luts
    from tngram.data.build import open_dataset
    from tngram.data.loader import load_val_tokens
    from tngram.data.tokenizer import load_tokenizer
    from tngram.eval.bpb import evaluate_bpb
    from tngram.memory.cp_rank import choose_keep, component_scores, prune_tngram, tngram_modules
    from tngram.model.gpt import GPT
    from tngram.train.checkpoint import load_weights

    info = open_dataset(data_dir)
    T, B = cfg.model.sequence_len, cfg.data.micro_batch_seqs
    val = load_val_tokens(info.val_files, T, vocab_size=cfg.model.vocab_size)
    luts = token_byte_luts(load_tokenizer(info.tokenizer_path), cfg.model.vocab_size)
    amp = torch.bfloat16 if cfg.run.dtype == "bf16" else None

    def fresh() -> torch.nn.Module:
        m = GPT(replace(cfg.model, memory=replace(cfg.model.memory, prune_at_step=0)))
        load_weights(m, checkpoint / "model.safetensors")
        return m.eval()

    def loss(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(
                evaluate_bpb(m, val, T, luts, B, autocast_dtype=amp, max_tokens=val_tokens)[
                    "val_loss"
                ]
            )

    out: list[dict[str, Any]] = [
        {
            "tol": 0.0,
            "correct_scales": None,
            "ranks": [m.factors.shape[2] for _, m in tngram_modules(fresh())],
            "val_loss": loss(fresh()),
        }
    ]
    for tol in tols:
        for correct in (True, False):
            m = fresh()
            ranks = []
            for _, mod in tngram_modules(m):
                keep = choose_keep(component_scores(mod), tol, MIN_CP_RANK)
                ranks.append(prune_tngram(mod, keep, correct_scales=correct))
            out.append({"tol": tol, "correct_scales": correct, "ranks": ranks, "val_loss": loss(m)})
    return out


def _final_ranks(row: dict[str, Any]) -> list[int]:
    return list(row.get("cp_ranks") or [row["start_rank"]])


def report_body(
    rows: list[dict[str, Any]],
) -> tuple[str, dict[str, list[tuple[float, float, float]]]]:
    """Markdown tables + goal check, and the plot series (x = Δparams in M, y = val loss)."""
    fixed = [r for r in rows if r["variant"] == "fixed"]
    adapt = [r for r in rows if r["variant"] == "adaptive"]
    lines = [
        "Fixed CP rank (mean ± std over seeds; time = training time without evaluation):",
        "",
        "| R | seeds | Δparams | val loss | train time (s) |",
        "|---|---|---|---|---|",
    ]
    by_r: dict[int, list[dict[str, Any]]] = {}
    for r in fixed:
        by_r.setdefault(int(r["start_rank"]), []).append(r)
    stats = {}
    for R in sorted(by_r):
        rs = by_r[R]
        loss, dp, tm = (
            mean_std([x[k] for x in rs]) for k in ("val_loss", "delta_params", "train_time_s")
        )
        stats[R] = (loss, dp, tm, len(rs))
        lines.append(
            f"| {R} | {len(rs)} | {dp[0] / 1e6:.2f}M | {fmt_pm(*loss, len(rs))} | {tm[0]:.0f} |"
        )
    series: dict[str, list[tuple[float, float, float]]] = {
        "fixed R": [(s[1][0] / 1e6, s[0][0], s[0][1]) for _, s in sorted(stats.items())]
    }
    if adapt:
        lines += [
            "",
            f"Adaptive (start R = {adapt[0]['start_rank']}, pruned after step "
            f"{adapt[0]['prune_at_step']}, energy tolerance {PRUNE_TOL}; ranks per memory layer):",
            "",
            "| seed | picked ranks | Δparams | val loss | train time (s) |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(adapt, key=lambda x: x["seed"]):
            lines.append(
                f"| {r['seed']} | {', '.join(map(str, _final_ranks(r)))} | "
                f"{r['delta_params'] / 1e6:.2f}M "
                f"| {r['val_loss']:.4f} | {r['train_time_s']:.0f} |"
            )
        series["adaptive (per seed)"] = [
            (r["delta_params"] / 1e6, r["val_loss"], 0.0) for r in adapt
        ]
    if adapt and stats:
        best = min(stats, key=lambda R: stats[R][0][0])
        (bl, _), (bd, _), (bt, _), bn = stats[best]
        al, ad, at = (
            mean_std([x[k] for x in adapt])[0] for k in ("val_loss", "delta_params", "train_time_s")
        )
        ok = [al - bl <= GOAL_NATS, ad <= GOAL_PARAMS * bd, at <= GOAL_TIME * bt]
        lines += [
            "",
            f"Goal check against the best fixed R = {best} ({bn} seeds; adaptive: {len(adapt)} "
            f"seeds):",
            "",
            f"- val loss: adaptive {al:.4f} vs {bl:.4f}, difference {al - bl:+.4f} nats "
            f"(goal <= +{GOAL_NATS}): {'met' if ok[0] else 'NOT met'}",
            f"- Δparams: {ad / 1e6:.2f}M = {ad / bd:.0%} of {bd / 1e6:.2f}M (goal <= "
            f"{GOAL_PARAMS:.0%}): "
            f"{'met' if ok[1] else 'NOT met'}",
            f"- training time: {at:.0f} s = {at / bt:.2f}x of {bt:.0f} s (goal <= {GOAL_TIME}x): "
            f"{'met' if ok[2] else 'NOT met'}",
            f"- overall: {'goal met' if all(ok) else 'goal NOT met'}",
        ]
    return "\n".join(lines), series


def _csv(rows: list[dict[str, Any]]) -> str:
    cols = [
        "label",
        "variant",
        "seed",
        "start_rank",
        "final_ranks",
        "delta_params",
        "val_loss",
        "val_bpb",
        "train_time_s",
    ]
    out = [",".join(cols)]
    for r in rows:
        vals = {**r, "final_ranks": " ".join(map(str, _final_ranks(r)))}
        out.append(",".join(str(vals.get(c, "")) for c in cols))
    return "\n".join(out) + "\n"


def write_report(out: Path, rows: list[dict[str, Any]], data_dir: str, timing: str = "") -> Path:
    from research.report.plots import xy_plot

    body, series = report_body(rows)
    if timing:
        body += "\n\n" + timing
    xy_plot(
        series,
        out / "adaptive-rank.png",
        "Δparams (M)",
        "val loss (nats/token)",
        "fixed CP rank vs adaptive rank",
    )
    atomic_write_text(out / "results.csv", _csv(rows))
    atomic_write_text(
        out / "report.md",
        f"# python -m research experiment adaptive-rank\n\nData: `{data_dir}`\n\n{body}\n\n"
        f"![adaptive-rank](adaptive-rank.png)\n",
    )
    print0(body)
    print0(f"\nreport: {out / 'report.md'}")
    return out / "report.md"


def run_adaptive_rank(
    out: Path,
    scale: str = "cpu",
    seeds: int = 3,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    ranks: tuple[int, ...] | None = None,
) -> Path:
    prefix = SCALES[scale]
    data_dir, vocab = resolve_data(data)
    specs = adaptive_specs(prefix, data_dir, vocab, seeds, steps, ranks or FIXED_RANKS)
    rows = run_all(
        specs, out, nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9")
    )
    return write_report(out, rows, data_dir, timing_section(specs[0].config, rows))
