"""Read run folders: metrics.jsonl rows and summary.json. Reporting never imports the trainer."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError, iter_jsonl


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise MissingFileError(f"{path} not found: is {run_dir} a tngram run folder?")
    rows = [obj for _, obj in iter_jsonl(path)]
    return rows


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise MissingFileError(f"{path} not found: the run in {run_dir} has not finished")
    return json.loads(path.read_text())


def mean_std(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def fmt_mean_std(values: list[float], digits: int = 4) -> str:
    m, s = mean_std(values)
    if math.isnan(m):
        return "–"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if len(values) > 1 else f"{m:.{digits}f}"


def fmt_params(n: float | None) -> str:
    if n is None or n == 0:
        return "–"
    return f"{n / 1e6:.2f}M"


def read_core(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's CORE result written by `tngram eval core`: eval/core.json, else the newest
    eval/core-max*.json; None when the run has not been evaluated."""
    ev = Path(run_dir) / "eval"
    full = ev / "core.json"
    if full.exists():
        return json.loads(full.read_text())
    partial = sorted(ev.glob("core-max*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(partial[-1].read_text()) if partial else None


def run_name(run_dir: str | Path) -> str:
    cfg = Path(run_dir) / "config.json"
    if cfg.exists():
        return str(json.loads(cfg.read_text()).get("name", Path(run_dir).name))
    return Path(run_dir).name
