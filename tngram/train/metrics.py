"""Run records: env.json, the append-only metrics.jsonl, optional TensorBoard / W&B, progress.

metrics.jsonl holds one JSON object per logged step (`step`, `train_loss`, `lr`, `tokens`,
`tokens_per_s`; evaluation rows add `val_loss`, `val_bpb`). `step` counts finished optimiser
steps, so the row of step s reports the loss of the batch that update s was computed from and
the validation after s updates. On resume, rows after the checkpoint's step are dropped (they
came from the interrupted process and will be written again), as is a torn last line; a line
that does not parse (or is not a row: not an object with an integer step) is dropped alone, the
good rows around it are kept. The kept rows are written to a new file renamed over the old one
(tngram.safefs), and later rows are appended to that new file: a hard-linked copy of the run
never changes its original, and a link at RUN/metrics.jsonl is replaced, never followed. Only the
main process writes, under the run's lock.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tngram.common import json_text
from tngram.cpu import eta_seconds, fmt_duration

METRICS_FILE = "metrics.jsonl"


def git_info(path: str | os.PathLike) -> dict[str, Any]:
    """{"commit", "dirty"} of the git checkout holding `path`; None values outside a checkout."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def env_info(device: torch.device, world_size: int, grad_accum: int) -> dict[str, Any]:
    """Provenance of a run: code version, library versions, hardware, process layout."""
    import numpy
    import tngram
    from tngram.kernels import resolved_impl, self_check_results
    from tngram.optim.muon import muon_impl

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
        "loadavg_1min": _loadavg(),  # the machine's load when the run started (report.md)
        "device": str(device),
        "world_size": world_size,
        "grad_accum_steps": grad_accum,
        "tngram_lookup_impl": resolved_impl(device),  # what a TN-gram memory's fused lookup runs
        "lookup_self_checks": self_check_results(),  # compiled kernels vs torch (first use)
        "muon_impl": muon_impl(device),  # Muon's matrices one by one or stacked by shape
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete row of DIR/metrics.jsonl (a torn last line is skipped)."""
    from tngram.safefs import read_bytes

    path = Path(run_dir) / METRICS_FILE
    if not os.path.lexists(path):
        return []
    rows = []
    for line in read_bytes(path, run_dir).splitlines():
        row = parse_row(line)
        if row is not None:
            rows.append(row)
    return rows


def last_logged_loss(run_dir: str | os.PathLike) -> float | None:
    """The train loss of the last row of RUN/metrics.jsonl that has one (None without)."""
    rows = [r for r in read_metrics(run_dir) if "train_loss" in r]
    return rows[-1]["train_loss"] if rows else None


def parse_row(line: bytes) -> dict[str, Any] | None:
    """One metrics row: a JSON object whose "step" is an int >= 0; None for anything else."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or absurdly nested
        return None
    if not isinstance(row, dict):
        return None
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return row


def kept_rows_bytes(data: bytes, keep_until_step: int | None) -> bytes:
    """The complete, well-formed rows of a metrics file with step <= keep_until_step, in order
    (a bad line is dropped alone; a torn last line is dropped; everything when keep_until_step is
    None: a fresh run)."""
    if keep_until_step is None:
        return b""
    out = []
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # torn last line
        row = parse_row(line)
        if row is None:
            continue
        if row["step"] > keep_until_step:
            break
        out.append(line)
    return b"".join(out)


class MetricsLog:
    """Appends rows to DIR/metrics.jsonl on the main process (always: the source of truth), and
    to TensorBoard (DIR/tb) or Weights & Biases (DIR/wandb; WANDB_MODE=offline needs no account)
    when `logger` asks for it."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        keep_until_step: int | None,
        logger: str = "none",
        run_name: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        from tngram.safefs import make_dirs, read_bytes, replace_for_append

        old = b""
        if keep_until_step is not None and os.path.lexists(self.path):
            old = read_bytes(self.path, run_dir)
        # a new file renamed over the old one, then appended to (see the module doc)
        self._file = replace_for_append(self.path, kept_rows_bytes(old, keep_until_step), run_dir)
        if logger == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # checked by check_logger before work

            self.tb = SummaryWriter(log_dir=str(make_dirs(run_dir, run_dir / "tb")))
        elif logger == "wandb":
            import wandb

            make_dirs(run_dir, run_dir / "wandb")  # wandb writes under RUN/wandb: never a link
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "tngram"),
                name=run_name,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=_wandb_id(run_dir),
            )

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write((json_text(row) + "\n").encode("utf-8"))
        self._file.flush()
        scalars = {
            k: v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)
        }
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
    from tngram.safefs import read_text, write_bytes

    path = run_dir / "wandb_id"
    if os.path.lexists(path):
        rid = read_text(path, run_dir, limit=4096).strip()
        if rid.isalnum():
            return rid
    import uuid

    rid = uuid.uuid4().hex[:12]
    write_bytes(path, (rid + "\n").encode(), run_dir)
    return rid


def check_logger(logger: str) -> None:
    """Fail before any work when the chosen logger is not installed."""
    import importlib.util

    from tngram.common import TngramError

    if logger not in ("none", "tensorboard", "wandb"):
        raise TngramError(f"--logger must be none, tensorboard or wandb, got {logger!r}")
    if logger != "none" and importlib.util.find_spec(logger) is None:  # the extra's own name
        raise TngramError(
            f"--logger {logger} needs the {logger} package: pip install 'tngram[{logger}]'"
        )


def progress_line(
    desc: str,
    step: int,
    total: int,
    loss: float,
    tokens_per_s: float,
    elapsed_s: float,
    eta_s: float,
) -> str:
    """One plain progress line, e.g. "mini-tngram: step 40/200 loss 5.1234 9,868 tokens/s,
    1 min 05 s elapsed, ETA 4 min 20 s" (durations as tngram.cpu.fmt_duration; ETA "?" when
    unknown)."""
    return (
        f"{desc}: step {step}/{total} loss {loss:.4f} {tokens_per_s:,.0f} tokens/s, "
        f"{fmt_duration(elapsed_s)} elapsed, ETA {fmt_duration(eta_s)}"
    )


def tail_seconds(
    step_s: float,
    tokens_per_step: int,
    val_tokens: int,
    val_s: float | None = None,
    save_s: float | None = None,
) -> float:
    """Seconds a run takes after its last optimiser step: the final validation and the final
    checkpoint. Each is its measured time when the run did one already (`val_s`, `save_s`);
    otherwise validation is costed as a forward pass over `val_tokens` at a third of a training
    token's time (forward + backward is ~3 forwards: 2 FLOPs per parameter and token forward,
    4 backward) and an unseen checkpoint as one step. `step_s`: mean seconds per step so far."""
    if not math.isfinite(step_s) or step_s < 0:
        return float("nan")
    if val_s is None:
        val_s = step_s * val_tokens / max(1, tokens_per_step) / 3
    return float(val_s + (step_s if save_s is None else save_s))


def timed(attr: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Method decorator: each call's wall seconds are stored in `self.<attr>` (also when it
    raises), e.g. the trainer's last validation / checkpoint time for the ETA's tail."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                setattr(self, attr, time.perf_counter() - t0)

        return call

    return wrap


class Progress:
    """Progress on the main process; silent elsewhere. With `bar` (a terminal): a tqdm bar (loss,
    tokens/s, the final validation + checkpoint still to come; tqdm's [elapsed<remaining]).
    Without (batch jobs, CI, nohup, --no-progress): one plain line on stderr every `log_every`
    steps and at the last step, with the elapsed time of this session and the ETA at its mean
    step rate plus the final validation and checkpoint (`tail`: seconds per step -> seconds
    after the last step, e.g. tail_seconds; none: 0)."""

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        enabled: bool,
        bar: bool = True,
        log_every: int = 10,
        tail: Callable[[float], float] | None = None,
    ) -> None:
        self.bar = None
        self.tail = tail
        self.plain = enabled and not bar
        self.total, self.step, self.desc, self.log_every = total, initial, desc, max(1, log_every)
        self.initial, self.t0 = initial, time.monotonic()
        if enabled and bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, loss: float, tokens_per_s: float) -> None:
        self.step += 1
        if self.bar is not None:
            post = {"loss": f"{loss:.4f}", "tok_s": f"{tokens_per_s:,.0f}"}
            done = self.step - self.initial
            if self.tail is not None and done > 0:  # tqdm's <remaining> is the steps only
                step_s = (time.monotonic() - self.t0) / done
                post["then"] = f"{fmt_duration(self.tail(step_s))} val+ckpt"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
        elif self.plain and (self.step % self.log_every == 0 or self.step == self.total):
            elapsed = time.monotonic() - self.t0
            done = self.step - self.initial
            eta = eta_seconds(done, self.total - self.initial, elapsed)
            if self.tail is not None and done > 0:
                eta += self.tail(elapsed / done)
            print(
                progress_line(self.desc, self.step, self.total, loss, tokens_per_s, elapsed, eta),
                file=sys.stderr,
                flush=True,
            )

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        elif self.plain:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
