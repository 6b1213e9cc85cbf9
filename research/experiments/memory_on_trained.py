"""`python -m research experiment memory-on-trained`: add a memory to an already-trained model,
train only it.

Per seed s:
    raw-s       the raw GPT trained from scratch (the "trained model"; also the frozen baseline)
    M-scratch-s the recipe with memory M (TN-gram, Engram) trained from scratch, all parameters
    M-frozen-s  the same recipe initialised from raw-s (run.init_from), backbone frozen
                (optim.trainable=memory); only the memory is trained, with the recipe's schedule

Reported per memory (mean ± std over seeds):
    gain recovered = (L_raw - L_frozen) / (L_raw - L_scratch)      val losses, same seed

i.e. how much of the from-scratch improvement over the raw model a memory added afterwards
recovers. Caveat: the frozen runs' models saw twice the tokens (raw pretraining + memory phase),
on the same data order (same loader seed), so the comparison favours them in tokens seen while
they train far fewer parameters. Writes OUT/results.csv and OUT/report.md.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import TngramError, atomic_write_text, print0
from research.experiments.common import (
    SCALES,
    base_recipe,
    resolve_data,
    with_data,
    with_seed,
    with_steps,
)
from tngram.experiments.runner import RunSpec, run_all, run_dir_of
from research.report.plots import fmt_pm
from tngram.report.runs import mean_std

MEMORIES = ("tngram", "engram")


def recovered_fraction(raw: float, scratch: float, frozen: float) -> float:
    """(raw - frozen) / (raw - scratch): 1.0 = the memory added later gives the full from-scratch
    gain."""
    if raw == scratch:
        raise TngramError(
            "the from-scratch memory run has the raw model's val loss: no gain to recover"
        )
    return (raw - frozen) / (raw - scratch)


def build_specs(
    out: Path, prefix: str, data_dir: str, vocab: int, seeds: int, steps: int | None
) -> list[RunSpec]:
    """Raw runs first (the frozen runs load their weights), then scratch and frozen memory runs."""

    def cfg_of(method: str, s: int):
        return with_steps(
            with_seed(with_data(base_recipe(prefix, method), data_dir, vocab), s), steps
        )

    specs = [
        RunSpec(f"raw-s{s}", cfg_of("raw", s), {"method": "raw", "variant": "raw", "seed_index": s})
        for s in range(seeds)
    ]
    for s in range(seeds):
        raw_dir = run_dir_of(out, specs[s]).resolve()
        for m in MEMORIES:
            specs.append(
                RunSpec(
                    f"{m}-scratch-s{s}",
                    cfg_of(m, s),
                    {"method": m, "variant": "scratch", "seed_index": s},
                )
            )
            frozen = cfg_of(m, s)
            frozen = replace(
                frozen,
                name=f"{frozen.name}-on-raw",
                run=replace(frozen.run, init_from=str(raw_dir)),
                optim=replace(frozen.optim, trainable="memory"),
            )
            specs.append(
                RunSpec(
                    f"{m}-frozen-s{s}", frozen, {"method": m, "variant": "frozen", "seed_index": s}
                )
            )
    return specs


def summarize(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Per-memory table rows and the markdown report body."""
    by = {(r["method"], r["variant"], r["seed_index"]): r for r in rows}
    seeds = sorted({r["seed_index"] for r in rows if r["method"] == "raw"})
    raw = mean_std([by["raw", "raw", s]["val_loss"] for s in seeds])
    lines = [
        "| memory | from scratch (val loss) | frozen raw + memory (val loss) | gain recovered | "
        "trained params (scratch / frozen) |",
        "|---|---|---|---|---|",
    ]
    table = []
    for m in MEMORIES:
        sc = [by[m, "scratch", s]["val_loss"] for s in seeds]
        fr = [by[m, "frozen", s]["val_loss"] for s in seeds]
        rec = [
            100 * recovered_fraction(by["raw", "raw", s]["val_loss"], a, b)
            for s, a, b in zip(seeds, sc, fr)
        ]
        (scm, scs), (frm, frs), (rm, rs) = mean_std(sc), mean_std(fr), mean_std(rec)
        r0 = by[m, "scratch", seeds[0]]
        table.append(
            {
                "memory": m,
                "scratch": scm,
                "scratch_std": scs,
                "frozen": frm,
                "frozen_std": frs,
                "recovered_pct": rm,
                "recovered_pct_std": rs,
            }
        )
        n = len(seeds)
        lines.append(
            f"| {m} | {fmt_pm(scm, scs, n)} | {fmt_pm(frm, frs, n)} | {fmt_pm(rm, rs, n, '.0f')} % "
            f"| "
            f"{r0['total_params']:,} / {r0['memory_params']:,} |"
        )
    body = (
        f"Frozen raw model (val loss): {fmt_pm(*raw, len(seeds))}; {len(seeds)} seed(s).\n\n"
        + "\n".join(lines)
        + "\n\ngain recovered = (raw − frozen+memory) / (raw − scratch), per seed, "
        "then mean ± std. The frozen runs' models saw twice the training tokens (raw pretraining + "
        "the memory phase, same data order)."
    )
    return table, body


def run(
    out: Path,
    scale: str = "cpu",
    seeds: int = 3,
    data: str | None = None,
    steps: int | None = None,
    nproc: int | None = None,
) -> Path:
    if seeds < 1:
        raise TngramError(f"--seeds must be >= 1, got {seeds}")
    data_dir, vocab = resolve_data(data)
    specs = build_specs(Path(out), SCALES[scale], data_dir, vocab, seeds, steps)
    rows = run_all(specs, Path(out), nproc=nproc or 1)
    _, body = summarize(rows)
    import csv
    import io

    buf = io.StringIO()
    cols = [
        "label",
        "method",
        "variant",
        "seed",
        "total_params",
        "memory_params",
        "tokens",
        "val_loss",
        "val_bpb",
        "train_loss",
        "wall_s",
    ]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(Path(out) / "results.csv", buf.getvalue())
    atomic_write_text(
        Path(out) / "report.md",
        f"# python -m research experiment memory-on-trained\n\nData: `{data_dir}`\n\n{body}\n",
    )
    print0(body)
    print0(f"\nreport: {Path(out) / 'report.md'}")
    return Path(out) / "report.md"
