"""Run records: env.json, the append-only metrics.jsonl, optional TensorBoard / W&B, progress.

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

from tngram.common import atomic_write_text

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
    from tngram.kernels import resolved_impl, self_check_results
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
        "lookup_self_checks": self_check_results(),    # compiled kernels vs torch (first use)
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
    """Appends rows to DIR/metrics.jsonl on the main process (always: the source of truth), and
    to TensorBoard (DIR/tb) or Weights & Biases (DIR/wandb; WANDB_MODE=offline needs no account)
    when `logger` asks for it."""

    def __init__(self, run_dir: Path, enabled: bool, keep_until_step: int | None, logger: str = "none",
                 run_name: str = "", config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        self._file = open(self.path, "a+b")
        self._file.seek(0)
        cut = kept_prefix_bytes(self._file.read(), keep_until_step)
        self._file.truncate(cut)      # in place: same file, same inode; O_APPEND writes after it
        self._file.flush()
        if logger == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # checked by check_logger before work
            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        elif logger == "wandb":
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "tngram"), name=run_name,
                                    dir=str(run_dir), config=config, resume="allow",
                                    id=_wandb_id(run_dir))

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write((json.dumps(row) + "\n").encode("utf-8"))
        self._file.flush()
        scalars = {k: v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    """A W&B run id kept in DIR/wandb_id, so a resumed run continues the same W&B run."""
    path = run_dir / "wandb_id"
    if path.is_file():
        return path.read_text().strip()
    import uuid
    rid = uuid.uuid4().hex[:12]
    atomic_write_text(path, rid + "\n")
    return rid


def check_logger(logger: str) -> None:
    """Fail before any work when the chosen logger is not installed."""
    from tngram.common import TngramError
    need = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}.get(logger)
    if logger not in ("none", "tensorboard", "wandb"):
        raise TngramError(f"--logger must be none, tensorboard or wandb, got {logger!r}")
    if need is not None:
        import importlib.util
        if importlib.util.find_spec(need[0]) is None:
            raise TngramError(f"--logger {logger} needs the {need[1]} package: pip install 'tngram[{need[1]}]'")


class Progress:
    """Progress on the main process; silent elsewhere. With `bar` (a terminal): a tqdm bar (loss,
    tokens/s, ETA). Without (batch jobs, CI, nohup, --no-progress): one plain line on stderr every
    `log_every` steps and at the last step."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool, bar: bool = True,
                 log_every: int = 10) -> None:
        self.bar = None
        self.plain = enabled and not bar
        self.total, self.step, self.desc, self.log_every = total, initial, desc, max(1, log_every)
        if enabled and bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def update(self, loss: float, tokens_per_s: float) -> None:
        self.step += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif self.plain and (self.step % self.log_every == 0 or self.step == self.total):
            print(f"{self.desc}: step {self.step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tokens/s",
                  file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        elif self.plain:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
