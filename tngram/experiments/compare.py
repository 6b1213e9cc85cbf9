"""`tngram compare`: raw GPT vs Engram vs TN-gram (and Over-Encoding) on the same data, in the same
order, from the same backbone initialisation (paper Table 1), with a report and loss curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tngram.common import atomic_write_json, print0
from tngram.experiments.common import (
    PRESETS,
    base_recipe,
    default_nproc,
    resolve_data,
    with_data,
    with_seed,
    with_steps,
)
from tngram.experiments.runner import RunSpec, run_all
from tngram.report.compare import write_compare_report
from tngram.train.config import TrainConfig

METHODS = ("raw", "engram", "tngram")


def compare(
    preset: str,
    out: Path,
    seeds: int = 1,
    data: str | None = None,
    with_oe: bool = False,
    steps: int | None = None,
    nproc: int | None = None,
) -> dict[str, Any]:
    """The `tngram compare` command: recipes `{preset prefix}-{method}` on one dataset."""
    prefix = PRESETS[preset]
    methods = METHODS + (("oe",) if with_oe else ())
    data_dir, vocab = resolve_data(data)
    configs = {
        m: with_steps(with_data(base_recipe(prefix, m), data_dir, vocab), steps) for m in methods
    }
    return compare_configs(
        configs,
        out,
        seeds=seeds,
        preset=preset,
        data_dir=data_dir,
        nproc=nproc or default_nproc(preset),
    )


def compare_configs(
    configs: dict[str, TrainConfig],
    out: Path,
    seeds: int = 1,
    preset: str = "custom",
    data_dir: str = "",
    nproc: int = 1,
) -> dict[str, Any]:
    """Train each method's config for every seed (seed i adds i to run.seed, so all methods of one
    seed share the backbone initialisation and the data order), then write results and report."""
    specs = []
    for s in range(seeds):
        for method, cfg in configs.items():
            c = with_seed(cfg, s)
            specs.append(RunSpec(f"{method}-s{s}", c, {"method": method, "seed": c.run.seed}))
    rows = run_all(specs, out, nproc=nproc)
    keep = (
        "method",
        "seed",
        "delta_params",
        "train_loss",
        "val_loss",
        "val_bpb",
        "core",
        "tokens_per_s",
        "wall_s",
        "run_dir",
    )
    results: dict[str, Any] = {
        "preset": preset,
        "data": data_dir,
        "seeds": seeds,
        "rows": [{k: r.get(k) for k in keep} for r in rows],
    }
    atomic_write_json(out / "results.json", results)
    report = write_compare_report(out, results)
    print0("\n" + report["table"])
    print0(f"\nreport: {out / 'report.md'}\nresults: {out / 'results.json'}")
    print0(next_steps(out, results["rows"], report.get("png")))
    return results


def next_steps(out: Path, rows: list[dict[str, Any]], png: Path | None) -> str:
    """What to try after a comparison: sample the last run (a memory run when there is one), read
    the report and the figure."""
    import shlex

    run = shlex.quote(str(rows[-1]["run_dir"])) if rows else shlex.quote(str(out / "runs" / "RUN"))
    method = rows[-1]["method"] if rows else "last"
    lines = [
        "",
        "next:",
        f'  tngram sample {run} --prompt "The history of"    # text from the {method} run',
        f"  tngram eval bpb {run}    # its validation loss and bits per byte",
        f"  the report {shlex.quote(str(out / 'report.md'))}"
        + (f" and the loss curves {shlex.quote(str(png))}" if png else ""),
    ]
    return "\n".join(lines)
