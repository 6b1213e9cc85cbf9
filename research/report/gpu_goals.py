"""The GPU goal, point by point, from the `python -m research bench gpu` results files (the
"gpu:goals" block
of research/GPU.md; the index research/results/gpu.json lists the files oldest first in "order").

Each point reads one kind of item, and its row shows the newest run that measured it, that run's
file and commit, and whether it meets the point:

    raw speed       the trainer's paper-l9-raw at its defaults: tokens/s >= RAW_GOAL_TPS
    TN-gram step    the trainer's TN-gram recipes beside paper-l9-engram in one run, at least
                    MIN_STEPS steps, defaults: some recipe's step <= Engram's (the step time
                    is tokens per step / tokens per s) with val bpb <= Engram's
    large vocab     tables at V BIG_V: each memory's `sparse` step <= BIG_RATIO x the raw step
    sparse <= dense tables at every V >= SPARSE_FROM_V: each memory's `sparse` step <= its
                    `dense` step

A run counts as "defaults" when it passed no --set to the trainer, no kernel policy and no
allocator setting. Medians throughout (the trainer's per-step windows; the table steps' reps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from research.report.gpu_cells import ok
from research.report.markdown import md_row

RAW_GOAL_TPS = 1_500_000  # parameter-golf's per-GPU rate for the same backbone (research/GPU.md)
MIN_STEPS = 30
BIG_V, BIG_RATIO = 131_072, 1.2
SPARSE_FROM_V = 8192
MEMORIES = (("engram", "Engram"), ("tngram", "TN-gram"))

Measure = tuple[str, bool]  # (what was measured, in words; whether it meets the point)


def at_defaults(run: dict[str, Any]) -> bool:
    """The run changed none of the trainer's settings (module docstring)."""
    shapes = run.get("shapes") or {}
    return (
        not shapes.get("trainer_sets")
        and not run.get("kernel_policy")
        and not run.get("alloc_conf")
    )


def _trainer(run: dict[str, Any], recipe: str) -> dict[str, Any] | None:
    r = (run.get("sections") or {}).get("trainer", {}).get(recipe)
    return r if ok(r) and r.get("tokens_per_s") else None


def raw_speed(run: dict[str, Any]) -> Measure | None:
    r = _trainer(run, "paper-l9-raw")
    if r is None or not at_defaults(run):
        return None
    tps = r["tokens_per_s"]
    return (
        f"{tps:,.0f} tokens/s ({tps / RAW_GOAL_TPS:.3f} of {RAW_GOAL_TPS:,})",
        tps >= RAW_GOAL_TPS,
    )


def tngram_step(run: dict[str, Any]) -> Measure | None:
    eng = _trainer(run, "paper-l9-engram")
    if eng is None or not at_defaults(run) or eng.get("steps", 0) < MIN_STEPS:
        return None
    rows = []  # (step ÷ Engram's, recipe, val bpb)
    for name in run.get("recipes", []):
        r = _trainer(run, name) if name.startswith("paper-l9-tngram") else None
        if r is not None and r.get("steps", 0) >= MIN_STEPS:
            rows.append((eng["tokens_per_s"] / r["tokens_per_s"], name, r.get("val_bpb")))
    if not rows:
        return None
    e_bpb = eng.get("val_bpb")
    meeting = [
        (x, n, b)
        for x, n, b in rows
        if x <= 1.0 and b is not None and e_bpb is not None and b <= e_bpb
    ]
    # shown: the fastest recipe that meets the point, else the fastest of all
    ratio, name, bpb = min(meeting or rows, key=lambda row: row[0])
    short = name.removeprefix("paper-l9-tngram") or "paper-l9-tngram"
    loss = f", val bpb {bpb:.4f} against {e_bpb:.4f}" if bpb is not None and e_bpb else ""
    which = "meets it" if meeting else "closest"
    text = f"{which} `{short}`: {ratio:.3f}× Engram's step{loss} ({len(rows)} TN-gram recipes)"
    return text, bool(meeting)


def _table_ms(run: dict[str, Any], key: str) -> float | None:
    r = (run.get("sections") or {}).get("tables", {}).get(key)
    return r["median_ms"] if ok(r) else None


def big_vocab(run: dict[str, Any]) -> Measure | None:
    raw = _table_ms(run, f"raw@{BIG_V}")
    got = [(label, _table_ms(run, f"{m}@{BIG_V}/sparse")) for m, label in MEMORIES]
    if raw is None or any(ms is None for _, ms in got):
        return None
    ratios = [(label, ms / raw) for label, ms in got if ms is not None]
    text = ", ".join(f"{label} {x:.2f}×" for label, x in ratios) + " the raw step"
    return text, all(x <= BIG_RATIO for _, x in ratios)


def sparse_vs_dense(run: dict[str, Any]) -> Measure | None:
    vocabs = [v for v in (run.get("shapes") or {}).get("vocabs", []) if v >= SPARSE_FROM_V]
    parts, met, seen = [], True, False
    for V in vocabs:
        cells = []
        for m, label in MEMORIES:
            s, d = _table_ms(run, f"{m}@{V}/sparse"), _table_ms(run, f"{m}@{V}/dense")
            if s is None or d is None:
                continue
            seen = True
            met = met and s <= d
            cells.append(f"{label} {s / d:.2f}×")
        if cells:
            parts.append(f"V {V:,}: " + ", ".join(cells))
    if not seen:
        return None
    return "; ".join(parts) + " its `dense` step", met


# (the point, in words; its measure)
GOALS: tuple[tuple[str, Callable[[dict[str, Any]], Measure | None]], ...] = (
    (f"`tngram train paper-l9-raw` at ≥ {RAW_GOAL_TPS:,} tokens/s", raw_speed),
    (f"a TN-gram step ≤ Engram's with equal or lower loss ({MIN_STEPS}+ steps)", tngram_step),
    (f"at V {BIG_V:,}, a `sparse` memory step ≤ {BIG_RATIO}× the raw step", big_vocab),
    (f"`sparse` never slower than `dense` at V ≥ {SPARSE_FROM_V:,}", sparse_vs_dense),
)


def goals_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """One row per point: its newest measurement among `runs` (oldest first), or open."""
    lines = ["| the goal, on one card | newest measurement | from | met |", "|---|---|---|---|"]
    for label, measure in GOALS:
        found = [(name, run, m) for name, run in runs if (m := measure(run)) is not None]
        if not found:
            lines.append(md_row([label, "not measured", "–", "open"]))
            continue
        name, run, (text, met) = found[-1]
        where = f"`{name}` ({run.get('commit', '?')})"
        lines.append(md_row([label, text, where, "**yes**" if met else "no"]))
    return "\n".join(lines)
