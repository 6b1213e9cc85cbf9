"""Read run folders: metrics.jsonl rows and summary.json. Reporting never imports the trainer."""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

from tngram.common import MissingFileError


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    from tngram.readback import BadRecordError, parse_json
    from tngram.safefs import read_bytes

    path = Path(run_dir) / "metrics.jsonl"
    if not os.path.lexists(path):
        raise MissingFileError(f"{path} not found: is {run_dir} a tngram run folder?")
    rows = []
    for lineno, line in enumerate(read_bytes(path, run_dir).splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, f"{path}: line {lineno}")
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise BadRecordError(
                f"{path}: line {lineno}: a metrics row must be an object with an int "
                f"step >= 0, got {line[:60]!r}"
            )
        for k, v in row.items():
            if k != "step" and (
                isinstance(v, bool) or not (v is None or isinstance(v, (int, float)))
            ):
                raise BadRecordError(
                    f"{path}: line {lineno}: field {k!r} must be a number, got {v!r}"[:200]
                )
        rows.append(row)
    return rows


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
