"""A run folder's file names and its checkpoint listing: what is where, nothing loaded.

The lowest module of tngram.train beside config: config validation (run.init_from, see
tngram.train.init_from) and the checkpoint code (tngram.train.checkpoint) both ask it, so the
config never reaches up to the checkpoint loader.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tngram.safefs import check_chain, real_dir

CKPT_DIR = "checkpoints"
FINAL_WEIGHTS = "model.safetensors"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


# ---- listing


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint folders of a run (renamed into place, so complete when written), oldest first.
    They are not verified here: see tngram.train.checkpoint (`verify_checkpoint`,
    `newest_good_checkpoint`)."""
    root = Path(run_dir) / CKPT_DIR
    check_chain(run_dir, root, include_self=True)  # never a linked checkpoints/ folder
    if not real_dir(root):
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_RE.match(p.name)) and real_dir(p)
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    return latest_checkpoint(run_dir) is not None


def checkpoint_step(path: Path) -> int:
    m = _STEP_RE.match(path.name)
    if m is None:  # callers pass folders list_checkpoints found (named step_NNNNNN)
        raise ValueError(f"{path}: not a checkpoint folder (step_NNNNNN)")
    return int(m.group(1))
