"""Run records: env.json, the append-only metrics.jsonl, optional TensorBoard, the progress bar.

metrics.jsonl holds one JSON object per logged step (`step`, `train_loss`, `lr`, `tokens`,
`tokens_per_s`; evaluation rows add `val_loss`, `val_bpb`). `step` counts finished optimiser
steps, so the row of step s reports the loss of the batch that update s was computed from and
the validation after s updates. On resume, rows after the checkpoint's step are dropped (they
came from the interrupted process and will be written again), as is a torn last line: the file
is cut in place (truncated after the last kept row and appended to), never replaced, so there is
only ever one file that one handle writes. Only the main process writes, under the run's lock.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


METRICS_FILE = "metrics.jsonl"


def git_info(path: str | os.PathLike) -> dict[str, Any]:
    """{"commit", "dirty"} of the git checkout holding `path`; None values outside a checkout."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def env_info(device: torch.device, world_size: int, grad_accum: int) -> dict[str, Any]:
    """Provenance of a run: code version, library versions, hardware, process layout."""
    import numpy
    import tngram
    from tngram.kernels import resolved_impl
    info: dict[str, Any] = {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "git": git_info(Path(tngram.__file__).resolve().parent),
        "tngram": tngram.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "world_size": world_size,
        "grad_accum_steps": grad_accum,
        "tngram_lookup_impl": resolved_impl(device),   # what a TN-gram memory's fused lookup runs
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete row of DIR/metrics.jsonl (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def kept_prefix_bytes(data: bytes, keep_until_step: int | None) -> int:
    """Length of the leading complete rows of a metrics file with step <= keep_until_step
    (everything is dropped when keep_until_step is None: a fresh run)."""
    if keep_until_step is None:
        return 0
    end = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break                                   # torn last line
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict) or row.get("step", 0) > keep_until_step:
            break
        end += len(line)
    return end


class MetricsLog:
    """Appends rows to DIR/metrics.jsonl (and TensorBoard when importable) on the main process."""

    def __init__(self, run_dir: Path, enabled: bool, keep_until_step: int | None) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tb = None
        if not enabled:
            return
        self._file = open(self.path, "a+b")
        self._file.seek(0)
        cut = kept_prefix_bytes(self._file.read(), keep_until_step)
        self._file.truncate(cut)      # in place: same file, same inode; O_APPEND writes after it
        self._file.flush()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is an optional extra
            SummaryWriter = None
        if SummaryWriter is not None:
            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write((json.dumps(row) + "\n").encode("utf-8"))
        self._file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """tqdm bar (loss, tokens/s, ETA) on the main process; silent elsewhere."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
