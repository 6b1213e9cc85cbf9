"""Checkpoints without pickle: safetensors for tensors, JSON for everything else.

Layout of a run folder:

    DIR/config.json                    resolved TrainConfig (cfg.to_dict())
    DIR/checkpoints/step_000500/       one folder per checkpoint, renamed into place when complete
        model.safetensors              model state_dict (metadata: step)
        state.safetensors              optimiser state tensors + RNG states (torch uint8)
        meta.json                      step, token/time counters, loader state, optimiser
                                       param groups and non-tensor state, world size
    DIR/model.safetensors              final weights (metadata: step), written at the end

A checkpoint is written into a hidden temporary folder (every file fsync'ed) and renamed to
step_NNNNNN only when complete, so a process killed at any moment leaves either the previous
set of checkpoints or the new one; leftover temporary folders are ignored and cleaned up.
Only the last `keep` checkpoints are kept. Loading never unpickles: safetensors holds only
raw tensors, JSON only plain data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save
from torch import nn

from tngram.common import MissingFileError, TngramError, atomic_write_bytes, atomic_write_json

CKPT_DIR = "checkpoints"
FINAL_WEIGHTS = "model.safetensors"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


# ---- listing

def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))
             and (p / "meta.json").exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    return latest_checkpoint(run_dir) is not None


def checkpoint_step(path: Path) -> int:
    return int(_STEP_RE.match(path.name).group(1))


# ---- (de)serialisation helpers

def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _cpu(v) for k, v in model.state_dict().items()}


def optimizer_to_flat(name: str, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split opt.state_dict() into tensors ("optim/NAME/IDX/KEY") and a JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"optim/{name}/{idx}/{k}"] = _cpu(v)
            else:
                plain.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "plain_state": plain}


def optimizer_from_flat(name: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                        info: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    prefix = f"optim/{name}/"
    for key, v in tensors.items():
        if key.startswith(prefix):
            idx, k = key[len(prefix):].split("/", 1)
            state.setdefault(int(idx), {})[k] = v
    for idx, rest in info["plain_state"].items():
        state.setdefault(int(idx), {}).update(rest)
    groups = []
    for g in info["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/cuda_{i}"] = s
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in tensors.items() if k.startswith("rng/cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([v for _, v in cuda][: torch.cuda.device_count()])


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---- save / load

def save_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module,
                    optimizers: dict[str, torch.optim.Optimizer], meta: dict[str, Any],
                    keep: int) -> Path:
    """Write DIR/checkpoints/step_NNNNNN atomically, then delete all but the newest `keep`."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state: dict[str, torch.Tensor] = rng_tensors()
    opt_info = {}
    for name, opt in optimizers.items():
        t, info = optimizer_to_flat(name, opt)
        state.update(t)
        opt_info[name] = info
    _write_file(tmp / "model.safetensors", save(model_tensors(model), metadata={"step": str(step)}))
    _write_file(tmp / "state.safetensors", save(state, metadata={"step": str(step)}))
    _write_file(tmp / "meta.json", (json.dumps({**meta, "step": step, "optimizers": opt_info},
                                               indent=1) + "\n").encode())
    if final.exists():  # re-saving the same step (e.g. a resumed run that was already complete)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizers: dict[str, torch.optim.Optimizer] | None = None,
                    restore_rng_state: bool = True) -> dict[str, Any]:
    """Restore weights (and optimisers, RNG) from a checkpoint folder; returns its meta.json."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    load_weights(model, path / "model.safetensors", (optimizers or {}).values())
    if optimizers:
        state = load_file(str(path / "state.safetensors"))
        for name, opt in optimizers.items():
            if name not in meta["optimizers"]:
                raise TngramError(f"checkpoint {path} has no state for optimiser {name!r}")
            optimizer_from_flat(name, opt, state, meta["optimizers"][name])
        if restore_rng_state:
            restore_rng(state)
    return meta


def load_weights(model: nn.Module, file: str | os.PathLike,
                 optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
    tensors = load_file(str(file))
    # weights saved after adaptive CP-rank pruning have smaller TN-gram shapes than the config's
    # starting rank: shrink those modules first (the loaded values then overwrite them; the
    # optimisers are pointed at the new, smaller parameters)
    from tngram.memory.cp_rank import shrink_to_state
    shrink_to_state(model, tensors, optimizers)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise TngramError(f"weights in {file} do not fit the model: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")


def save_final_weights(run_dir: str | os.PathLike, model: nn.Module, step: int) -> Path:
    path = Path(run_dir) / FINAL_WEIGHTS
    atomic_write_bytes(path, save(model_tensors(model), metadata={"step": str(step)}))
    return path


def _weights_step(file: Path) -> int:
    from safetensors import safe_open
    with safe_open(str(file), framework="pt") as f:
        return int((f.metadata() or {}).get("step", -1))


def save_run_config(run_dir: str | os.PathLike, cfg_dict: dict[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / "config.json", cfg_dict)


def load_run_model(run_dir: str | Path, device: str = "cpu") -> tuple[nn.Module, dict]:
    """The trained model of a run folder (eval mode, on `device`) and its resolved config dict.

    Weights come from whichever is newer: the final weights DIR/model.safetensors or the latest
    checkpoint (a run still going, or interrupted, has only checkpoints).
    """
    from tngram.model.gpt import GPT
    from tngram.train.config import TrainConfig

    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.json"
    if not cfg_file.exists():
        raise MissingFileError(f"{run_dir} is not a run folder (no config.json)")
    cfg_dict = json.loads(cfg_file.read_text())
    candidates = []
    final = run_dir / FINAL_WEIGHTS
    if final.exists():
        candidates.append((_weights_step(final), 1, final))
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        candidates.append((checkpoint_step(ckpt), 0, ckpt / "model.safetensors"))
    if not candidates:
        raise TngramError(f"{run_dir} has no weights yet (no {FINAL_WEIGHTS}, no checkpoint)")
    weights = max(candidates)[2]
    cfg = TrainConfig.from_dict(cfg_dict)
    model = GPT(cfg.model)          # random init (cheap), overwritten by the weights below
    load_weights(model, weights)
    model.to(device).eval()
    return model, cfg_dict
