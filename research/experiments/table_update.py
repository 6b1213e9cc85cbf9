"""`python -m research experiment table-update`: what `optim.memory_update = sparse | rowwise`
costs in quality.

For each corpus, seed and memory (Engram at table_budget 3800, TN-gram at cp_rank 352: the pareto
map's recipe-size points, each at its tuned table lr), one run per update option. The `dense` run is
exactly the pareto run of the same point (same label, same config), so pointing --out at a pareto
folder reuses those runs; `sparse` / `rowwise` change only `optim.memory_update`, and their
`+catchup` twins also set `optim.memory_catchup` (the missed steps' moves added in closed form).
Pairs share the
seed (initialisation and data order) and corpus; the report gives, per corpus and memory, the
paired difference (option − dense) of validation loss with its 95% t interval
(tngram.report.stats). The goal stated for the options: within 0.005 nats of dense.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tngram.common import atomic_write_json, atomic_write_text, print0

POINTS = {"engram": 3800, "tngram": 352}  # pareto's recipe-size points (table_budget, cp_rank)
# option name -> (optim.memory_update, optim.memory_catchup)
UPDATES = {
    "sparse": ("sparse", False),
    "rowwise": ("rowwise", False),
    "sparse+catchup": ("sparse", True),
    "rowwise+catchup": ("rowwise", True),
}
GOAL_NATS = 0.005


def specs(
    corpora: list[str], prefix: str, seeds: int, steps: int | None, factors: dict[str, float]
) -> list[Any]:
    """The dense pareto specs of POINTS, each followed by its `sparse` and `rowwise` twins; ordered
    seed by seed so a partial run covers every corpus."""
    from research.experiments.pareto import specs_for

    dense = [
        s
        for s in specs_for(corpora, prefix, seeds, steps, factors, families=tuple(POINTS))
        if s.tags["size"] == POINTS[s.tags["family"]]
    ]
    out = []
    for s in dense:
        out.append(replace(s, tags={**s.tags, "update": "dense"}))
        for u, (mode, catchup) in UPDATES.items():
            cfg = replace(
                s.config, optim=replace(s.config.optim, memory_update=mode, memory_catchup=catchup)
            )
            label = s.label.rsplit("-s", 1)
            name = u.replace("+", "-")
            out.append(
                replace(
                    s,
                    label=f"{label[0]}-{name}-s{label[1]}",
                    config=cfg,
                    tags={**s.tags, "update": u},
                )
            )
    return out


def paired_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per (corpus, memory, option): n pairs, dense mean, paired mean difference and 95%
    CI of val loss (option − dense), and whether the whole interval lies within ±GOAL_NATS."""
    from tngram.report.stats import paired_stats

    by = {(r["corpus"], r["family"], r["update"], r["seed_index"]): r for r in rows}
    table = []
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        for fam in POINTS:
            for u in UPDATES:
                pairs = [
                    (by[k]["val_loss"], by[(corpus, fam, "dense", k[3])]["val_loss"])
                    for k in by
                    if k[:3] == (corpus, fam, u) and (corpus, fam, "dense", k[3]) in by
                ]
                if not pairs:
                    continue
                st = paired_stats([a - b for a, b in pairs])
                within = (
                    None
                    if st.n < 2
                    else ("yes" if -GOAL_NATS <= st.ci_low and st.ci_high <= GOAL_NATS else "no")
                )
                table.append(
                    [
                        corpus,
                        fam,
                        u,
                        st.n,
                        [b for _, b in pairs],
                        st.mean,
                        None if st.n < 2 else [st.ci_low, st.ci_high],
                        within,
                    ]
                )
    return table


COLUMNS = [
    {"header": "corpus"},
    {"header": "memory"},
    {"header": "update"},
    {"header": "pairs"},
    {"header": "dense val loss", "fmt": "mean_std:.4f"},
    {"header": "Δ val loss (update − dense)", "fmt": "+.4f"},
    {"header": "95% CI", "fmt": "list:+.4f"},
    {"header": f"CI within ±{GOAL_NATS}"},
]


def table_update(
    out: Path,
    scale: str = "cpu",
    seeds: int = 3,
    steps: int | None = None,
    nproc: int | None = None,
    corpora: list[str] | None = None,
    train: bool = True,
) -> Path:
    """Train (reusing finished runs) and write OUT/table-update.json, OUT/report.md and
    OUT/results/table-update.json (a research/results "table" file)."""
    import sys
    from research.experiments.common import SCALES, default_nproc
    from research.experiments.pareto import TUNED_DEFAULT, TUNING_CORPUS
    from tngram.experiments.runner import run_all, run_dir_of
    from tngram.readback import read_summary_file
    from research.report.docblocks import render_table
    from tngram.train.metrics import git_info

    prefix = SCALES[scale]
    corpora = list(corpora or ["default", TUNING_CORPUS, "code"])
    todo = specs(corpora, prefix, seeds, steps, dict(TUNED_DEFAULT))
    if train:
        run_all(todo, out, nproc=nproc or default_nproc("cpu" if scale == "cpu" else "paper-l9"))
    rows = []
    for s in todo:
        rdir = run_dir_of(out, s)
        if (rdir / "summary.json").is_file():
            rows.append(
                {**s.tags, "label": s.label, **read_summary_file(rdir / "summary.json", rdir)}
            )
    table = paired_rows(rows)
    g = git_info(Path(__file__).resolve().parent)
    meta = {
        "command": "python -m research experiment table-update " + " ".join(sys.argv[3:]),
        "commit": (g["commit"] or "unknown")[:12]
        + (" (uncommitted changes)" if g["dirty"] else ""),
        "machine": "see OUT/runs/*/env.json",
        "source": str(out / "table-update.json"),
    }
    atomic_write_json(out / "table-update.json", {"rows": rows, "table": table})
    results = {"kind": "table", **meta, "columns": COLUMNS, "rows": table}
    atomic_write_json(out / "results" / "table-update.json", results)
    md = (
        f"# python -m research experiment table-update\n\n{len(rows)} of {len(todo)} runs "
        "finished. Δ = val "
        f"loss of the "
        f"option − dense, paired by seed; goal: within ±{GOAL_NATS} nats.\n\n"
        + render_table(results)
        + "\n"
    )
    atomic_write_text(out / "report.md", md)
    print0(md)
    return out / "report.md"
