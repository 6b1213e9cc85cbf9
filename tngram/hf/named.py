"""Several named memories on one base: one memory runs, the others are kept aside.

    keep_memory(model, name)   the running memory (add_memory / load_memory / use_memory) is set
                               aside under `name`: the model is the plain base again
    use_memory(model, name)    the memory kept under `name` runs (a running memory is kept
                               aside first, under the name use_memory gave it)
    memory_names(model)        {"running": name or None, "kept": [names]}
    forget_memory(model, name) drop a kept memory

A kept memory is its modules and spec, held by the model object but outside its modules: it
is in no forward, no state_dict, no save_pretrained, no optimiser (parameters() does not list
it). Everything else acts on the running memory: disable_memory, save_memory, the trainers; to
save or train a kept one, use_memory it first. Switching back attaches the same modules (moved
to the model's device and dtype), so their weights and trained state are as they were. A cache
filled with one memory running is refused by another: start a new cache after switching.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tngram.common import TngramError
from tngram.hf.attach import (
    attach_from_spec,
    convert_to_memory_class,
    memory_owners,
    remove_memory,
)
from tngram.hf.classes import MEMORY_ATTR
from tngram.hf.peft_compat import refuse_peft
from tngram.hf.spec import base_model, memory_spec

KEPT = "_tngram_kept"  # on the outermost model: {name: (spec, {layer id: memory module})}
RUNNING = "_tngram_running_name"  # on the MemoryState of a memory use_memory attached


def _kept(model: nn.Module) -> dict[str, tuple[dict[str, Any], dict[int, nn.Module]]]:
    refuse_peft(model)
    return model.__dict__.setdefault(KEPT, {})


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TngramError(f"a memory name must be a non-empty str, got {name!r}")
    return name


def _running_name(model: nn.Module) -> str | None:
    state = getattr(base_model(model), "_tngram_state", None)
    return None if state is None else getattr(state, RUNNING, None)


def keep_memory(model: nn.Module, name: str) -> nn.Module:
    """Set the running memory aside under `name`; the model becomes the plain base. Refused when
    the model has no memory or `name` is already kept. Returns the model."""
    kept = _kept(model)
    name = _check_name(name)
    spec = memory_spec(model)
    if spec is None:
        raise TngramError("keep_memory: the model has no n-gram memory running")
    if name in kept:
        raise TngramError(f"keep_memory: a memory named {name!r} is kept already")
    modules = {i: owner._modules[MEMORY_ATTR] for i, owner in memory_owners(model).items()}
    remove_memory(model)
    kept[name] = (spec, modules)
    return model


def use_memory(model: nn.Module, name: str) -> nn.Module:
    """Run the memory kept under `name`. A memory running now is kept aside first under the name
    use_memory ran it with; a running memory without one (add_memory, load_memory) is refused:
    keep_memory(model, name) it first. Returns the model."""
    kept = _kept(model)
    name = _check_name(name)
    if name not in kept:
        raise TngramError(f"use_memory: no memory named {name!r} is kept (kept: {sorted(kept)})")
    running = _running_name(model)
    if memory_spec(model) is not None:
        if running is None:
            raise TngramError(
                "use_memory: the running memory has no name: keep_memory(model, name) it first"
            )
        keep_memory(model, running)
    spec, modules = kept.pop(name)
    ref = next(base_model(model).parameters())
    for m in modules.values():
        m.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
    convert_to_memory_class(model, spec)
    attach_from_spec(model, spec, built=modules)
    setattr(getattr(base_model(model), "_tngram_state"), RUNNING, name)
    return model


def memory_names(model: nn.Module) -> dict[str, Any]:
    """{"running": the running memory's name (None: none runs, or it has no name), "kept":
    the names kept aside, sorted}."""
    return {"running": _running_name(model), "kept": sorted(_kept(model))}


def forget_memory(model: nn.Module, name: str) -> nn.Module:
    """Drop the memory kept under `name` (remove_memory drops the running one)."""
    kept = _kept(model)
    if kept.pop(_check_name(name), None) is None:
        raise TngramError(f"forget_memory: no memory named {name!r} is kept")
    return model
