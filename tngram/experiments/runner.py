"""Run a list of training configs as subprocesses, reusing finished runs and resuming partial ones."""

from __future__ import annotations

import contextlib
import contextvars
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from tngram.common import TngramError, atomic_write_json, print0
from tngram.train.config import TrainConfig


@dataclass
class RunSpec:
    label: str                        # unique folder name under OUT/runs/
    config: TrainConfig
    tags: dict[str, Any] = field(default_factory=dict)   # method, seed, sweep value...


# `--set` items of `tngram compare` / `tngram experiment`, applied by run_all to every run
_OVERRIDES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("tngram_overrides", default=())


@contextlib.contextmanager
def config_overrides(items: list[str] | tuple[str, ...]) -> Iterator[None]:
    """Within the block, run_all applies these `section.field=value` items to every run's config
    (after the experiment's own settings); model.memory.* items skip runs without a memory."""
    token = _OVERRIDES.set(tuple(items))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def with_overrides(cfg: TrainConfig, items: tuple[str, ...] | list[str]) -> TrainConfig:
    from tngram.train.config import apply_overrides, split_override
    if cfg.model.memory is None:
        items = [i for i in items if not (split_override(i)[0].startswith("model.memory.")
                                          and split_override(i)[0] != "model.memory.kind")]
    return apply_overrides(cfg, list(items))


def run_dir_of(out: Path, spec: RunSpec) -> Path:
    return out / "runs" / spec.label


def is_complete(run_dir: Path, cfg: TrainConfig) -> bool:
    """Finished (summary.json written) with the same resolved config."""
    summary, config = run_dir / "summary.json", run_dir / "config.json"
    if not (summary.exists() and config.exists()):
        return False
    return _same_config(run_dir, cfg)


def check_same_dataset(run_dir: Path, cfg: TrainConfig) -> None:
    """Refuse a run folder trained on another version of the dataset at cfg's data path (its
    RUN/dataset.json fingerprint differs from the dataset there now, e.g. after a corpus was
    rebuilt with more sources): reusing or resuming it would mix two datasets in one table."""
    from tngram.data.build import default_data_dir
    from tngram.train.portable import read_dataset_record
    want = (read_dataset_record(run_dir) or {}).get("fingerprint")
    data_dir = Path(cfg.data.dir).expanduser() if cfg.data.dir else default_data_dir(cfg.model.vocab_size)
    manifest = data_dir / "manifest.json"
    if not want or not manifest.is_file():
        return   # a run from before dataset records, or no dataset to compare with yet
    have = json.loads(manifest.read_text(encoding="utf-8")).get("fingerprint")
    if have != want:
        raise TngramError(f"{run_dir} was trained on another version of {data_dir} (dataset fingerprint "
                          f"{want[:12]}, now {str(have)[:12]}); remove that folder or choose another --out")


def _normalized(saved: dict) -> dict:
    """A saved config.json as the current code resolves it: fields added since the run was made
    take their defaults (which keep the old behaviour), so finished runs stay reusable."""
    try:
        return json.loads(json.dumps(TrainConfig.from_dict(saved).to_dict()))
    except (TngramError, TypeError, KeyError, ValueError):
        return saved


def launch_command(nproc: int) -> list[str]:
    if nproc <= 1:
        return [sys.executable, "-m", "tngram.experiments.worker"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "tngram.experiments.worker"]


def run_all(specs: list[RunSpec], out: Path, nproc: int = 1) -> list[dict[str, Any]]:
    """Train every spec (in order) and return one row per run: tags + summary.json."""
    if _OVERRIDES.get():
        specs = [replace(s, config=with_overrides(s.config, _OVERRIDES.get())) for s in specs]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise TngramError(f"run labels must be unique, got {labels}")
    rows = []
    for i, spec in enumerate(specs, 1):
        rdir = run_dir_of(out, spec)
        if (rdir / "config.json").exists():
            check_same_dataset(rdir, spec.config)
        if is_complete(rdir, spec.config):
            print0(f"[{i}/{len(specs)}] {spec.label}: finished earlier, reused ({rdir})")
        else:
            if (rdir / "config.json").exists() and not _same_config(rdir, spec.config):
                raise TngramError(f"{rdir} holds a run with a different config; choose another --out "
                                  f"or remove that folder")
            rdir.mkdir(parents=True, exist_ok=True)
            cfg_path = rdir / "requested_config.json"
            atomic_write_json(cfg_path, spec.config.to_dict())
            print0(f"[{i}/{len(specs)}] {spec.label}: training ({rdir})")
            t0 = time.time()
            proc = subprocess.run(launch_command(nproc) + [str(cfg_path), str(rdir)])
            if proc.returncode != 0:
                raise TngramError(f"run {spec.label} failed (exit {proc.returncode}); its folder is {rdir}")
            print0(f"[{i}/{len(specs)}] {spec.label}: done in {time.time() - t0:.0f} s")
        summary = json.loads((rdir / "summary.json").read_text())
        rows.append({**spec.tags, "label": spec.label, "run_dir": str(rdir), **summary})
    return rows


def _same_config(rdir: Path, cfg: TrainConfig) -> bool:
    return _normalized(json.loads((rdir / "config.json").read_text())) == json.loads(json.dumps(cfg.to_dict()))
