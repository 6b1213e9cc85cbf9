"""The values of optim.trainable and the cheap check of run.init_from, for config validation.

`validate_config` (tngram.train.config) calls `check_init_from` before any data or model work;
the warm start itself (loading the weights, freezing the backbone) is tngram.train.warmstart,
which sits above the config and the checkpoint loader.
"""

from __future__ import annotations

from pathlib import Path

from tngram.common import TngramError
from tngram.train.runfiles import FINAL_WEIGHTS, latest_checkpoint

TRAINABLE = ("all", "memory")


def check_init_from(path: str) -> None:
    """Cheap validation (before any data or model work): DIR exists and holds weights."""
    d = Path(path)
    if not (d / "config.json").is_file():
        raise TngramError(
            f"run.init_from: {d} is not a run folder or an exported model (no config.json)"
        )
    if weights_file(d) is None:
        raise TngramError(
            f"run.init_from: {d} has no weights (no model.safetensors and no checkpoint)"
        )


def weights_file(d: Path) -> Path | None:
    """DIR's final weights, else its newest checkpoint's weights, else None."""
    if (d / FINAL_WEIGHTS).is_file():
        return d / FINAL_WEIGHTS
    ckpt = latest_checkpoint(d)
    return None if ckpt is None else ckpt / "model.safetensors"
