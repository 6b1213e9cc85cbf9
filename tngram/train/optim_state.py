"""Optimiser and RNG state in a checkpoint: flattened to safetensors tensors plus a JSON layout,
and restored with one-line errors naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tngram.common import TngramError
from tngram.train.ckpt_files import cpu_copy, short_error
from tngram.train.optim_check import check_optimizer_state


def optimizer_to_flat(
    name: str, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict]:
    """Split opt.state_dict() into tensors ("optim/NAME/IDX/KEY") and a JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"optim/{name}/{idx}/{k}"] = cpu_copy(v)
            else:
                plain.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "plain_state": plain}


def optimizer_from_flat(
    name: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], info: dict
) -> None:
    state: dict[int, dict[str, Any]] = {}
    prefix = f"optim/{name}/"
    for key, v in tensors.items():
        if key.startswith(prefix):
            idx, k = key[len(prefix) :].split("/", 1)
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
    cuda = sorted(
        (int(k.rsplit("_", 1)[1]), v) for k, v in tensors.items() if k.startswith("rng/cuda_")
    )
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([v for _, v in cuda][: torch.cuda.device_count()])


def load_optimizer_checked(
    where: Path | str,
    name: str,
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    layout: Any,
    step: Any,
) -> None:
    """`optimizer_from_flat` after every field was checked (tngram.train.optim_check, at the
    checkpoint's `step`); any failure one line naming `where` (state that does not fit)."""
    check_optimizer_state(where, name, opt, tensors, layout, step)
    try:
        optimizer_from_flat(name, opt, tensors, layout)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TngramError(
            f"{where}: optimiser {name!r} state does not fit this model ({short_error(e)})"
        ) from None


def restore_rng_checked(path: Path, state: dict[str, torch.Tensor]) -> None:
    """`restore_rng` from checkpoint folder `path`'s state.safetensors tensors, one line if absent
    or corrupt."""
    if "rng/torch_cpu" not in state:
        raise TngramError(f"{path / 'state.safetensors'}: no RNG state")
    try:
        restore_rng(state)
    except (RuntimeError, ValueError, TypeError) as e:
        raise TngramError(
            f"{path / 'state.safetensors'}: the RNG state is corrupt ({short_error(e)}); move "
            f"{path.name} away to resume from an older checkpoint"
        ) from None
