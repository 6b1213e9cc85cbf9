"""Shared pieces of the experiment commands: presets, data resolution, config edits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tngram.train.recipes import get_recipe
from tngram.train.config import TrainConfig

# preset -> recipe prefix
PRESETS = {"cpu": "mini", "paper-l9": "paper-l9", "paper-l18": "paper-l18"}


def resolve_data(data: str | None, vocab_size: int = 1024) -> tuple[str, int]:
    """(dataset dir, its vocab size): --data DIR, else the default offline corpus (built if
    missing)."""
    from tngram.data.build import ensure_default_data, open_dataset

    path = Path(data) if data else ensure_default_data(vocab_size=vocab_size)
    info = open_dataset(path)
    return str(info.dir), int(info.vocab_size)


def with_data(cfg: TrainConfig, data_dir: str, vocab_size: int) -> TrainConfig:
    return replace(
        cfg, data=replace(cfg.data, dir=data_dir), model=replace(cfg.model, vocab_size=vocab_size)
    )


def with_seed(cfg: TrainConfig, seed_index: int) -> TrainConfig:
    return replace(cfg, run=replace(cfg.run, seed=cfg.run.seed + seed_index))


def with_steps(cfg: TrainConfig, steps: int | None) -> TrainConfig:
    from tngram.train.config import with_schedule_steps

    return with_schedule_steps(cfg, steps)


def base_recipe(prefix: str, method: str) -> TrainConfig:
    return get_recipe(f"{prefix}-{method}")


def default_nproc(preset: str) -> int:
    import torch

    return 1 if preset == "cpu" else max(1, torch.cuda.device_count())
